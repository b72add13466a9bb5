"""Real federation across machines on Flower (an optional extra: `pip install -e '.[flower]'`).

- `codec`: parameter trees <-> message arrays; 16-bit wires as raw bits, decoded bit for bit.
- `protocol`: message kinds, record and config keys, and a recorder of everything sent.
- `node`: one client's share, its local part on its disk, the simulation's client computations.
- `client_app`: the Flower ClientApp (a SuperNode's clients); it imports no JAX and hands each
  message to the node's warm worker (`worker`), which runs its handler (`handlers`).
- `server`: rounds over a Flower Grid with the simulation's aggregation and server step.
- `preflight`: what `python -m fedjax_split.flower` checks before it starts any process.
- `server_app`: the Flower ServerApp.
- `logs`: one clean line per event, in the apps' processes and the launcher's log files.
- `launch`: a SuperLink and SuperNodes as processes on loopback (`python -m fedjax_split.flower`).
- `certs`: the CA, the SuperLink's TLS certificate and SuperNode keys of a secured federation.
- `secagg`: secure aggregation's protocol (SecAgg+), its stages pure functions: a node's
  (`secagg_node`), the server's (`secagg_server`), their primitives (`secagg_crypto`); the apps
  run them through `secure_node` and `secure_round`.

docs/deployment.md has the architecture and the commands for real machines.
"""
