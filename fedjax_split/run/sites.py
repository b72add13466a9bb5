"""Sites with their own data (`--site-data DIR0,DIR1,...`), for train's and pretrain's configs
alike: client k's examples or text are directory k's files, not drawn from one pool, so the
clients are the sites and a setting that splits a pool does not apply. What the setting means
and its checks are written here once; `node-config` (`NODE_SITES`) is real sites, where each
Flower SuperNode reads the directory of its own node config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedjax_split.errors import UserError
from fedjax_split.run.settings import as_given, drop
from fedjax_split.run.value_checks import first_set

NODE_SITES = "node-config"  # --site-data's value for real sites: each node's own data-dir


def site_dirs(config: Any) -> list[Path]:
    """--site-data's directories (train's or pretrain's config), client k's at k ([] without
    --site-data or with `node-config`, where each node knows its own)."""
    if config.data.site_data is None or config.data.site_data == NODE_SITES:
        return []
    return [Path(d.strip()).expanduser() for d in config.data.site_data.split(",")]


def implied_by_sites(
    file_values: dict[str, Any] | None, overrides: dict[str, Any] | None, **implied: Any
) -> dict[str, Any]:
    """`overrides`, with what --site-data DIR0,DIR1,... implies where neither they nor the
    config file's values set it: the clients are the sites (`node-config` names none here), and
    `implied` (pretrain's: the corpus is local)."""
    given = {**(file_values or {}), **(overrides or {})}
    sites = given.get("site_data")
    if not isinstance(sites, str):
        return dict(overrides or {})
    if sites != NODE_SITES:
        implied["clients"] = len(sites.split(","))
    return {**{k: v for k, v in implied.items() if k not in given}, **(overrides or {})}


def refuse_with_sites(config: Any, names: tuple[str, ...], what: str, instead: str) -> None:
    """UserError naming the first of `names` set to other than its default in a --site-data
    run, where it would be silently ignored: "each client's {what}", "drop --site-data to
    {instead}"."""
    given = first_set(config, names)
    if given is not None:
        raise UserError(f"{as_given(config, given)} with --site-data: each client's {what}; "
                        f"{drop(config, given)} (or drop --site-data to {instead})")  # fmt: skip


def check_site_dirs(config: Any) -> None:
    """--site-data DIR0,DIR1,... of train's or pretrain's config: one existing directory per
    client, none empty or named twice (`node-config`: nothing to check here)."""
    data_cfg = config.data
    if data_cfg.site_data is None or data_cfg.site_data == NODE_SITES:
        return
    texts = [d.strip() for d in data_cfg.site_data.split(",")]
    if not all(texts):
        raise UserError(
            f"--site-data {data_cfg.site_data!r} has an empty entry; pass DIR0,DIR1,... with one "
            "directory per client"
        )
    dirs = site_dirs(config)
    if config.federation.clients != len(dirs):
        raise UserError(
            f"{as_given(config, 'clients')} but --site-data names {len(dirs)} sites; "
            f"{drop(config, 'clients', unset=f'--clients {len(dirs)}')} (each site is one "
            "client)"
        )
    seen: dict[Path, int] = {}
    for k, d in enumerate(dirs):
        if not d.is_dir():
            what = "is a file, not a directory" if d.exists() else "does not exist"
            raise UserError(f"--site-data: site {k}'s directory {str(d)!r} {what}")
        first = seen.setdefault(d.resolve(), k)
        if first != k:
            raise UserError(f"--site-data names {str(d)!r} twice (sites {first} and {k}); "
                            "give each site its own directory")  # fmt: skip
