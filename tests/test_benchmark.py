"""tools/benchmark.py on a tiny model: its derived figures agree with what it measured."""

import importlib.util
import json
from pathlib import Path

import pytest

from fedjax_split.models.bert import BertConfig, init_params
from fedjax_split.models.flops import forward_flops, packed_forward_flops, train_step_flops

_SPEC = importlib.util.spec_from_file_location(
    "benchmark", Path(__file__).resolve().parents[1] / "tools" / "benchmark.py"
)
benchmark = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(benchmark)


def test_tiny_round_benchmark(tmp_path):
    out = tmp_path / "b.json"
    r = benchmark.main(["--model", "tiny", "--clients", "2", "--examples-per-client", "8",
                        "--batch-size", "4", "--lengths", "16", "--repeats", "1",
                        "--no-packing", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64)  # fmt: skip
    # 2 clients x 8 examples of 16 tokens, one epoch; 16 is a multiple of 8: no padding at all
    assert r["model_flops"] == 16 * train_step_flops(config, 1, 16)
    assert r["padding_waste"] == 0.0 and r["hardware_flops"] == r["model_flops"]
    assert r["real_tokens"] == 16 * 16
    rd = r["round"]
    assert rd["mfu"] == pytest.approx(r["model_flops"] / rd["seconds"] / r["peak"]["flops_per_s"])
    assert r["speedup_vs_sequential"] == pytest.approx(r["sequential"]["seconds"] / rd["seconds"])
    assert "| tiny | cpu | 2 | 4 | 16 |" in benchmark.markdown_row(r)
    assert r["machine"]["round_devices"] == 1  # vmapped: one program on one device


def test_tiny_step_profile():
    r = benchmark.main(["--model", "tiny", "--profile-step", "--batch-size", "2",
                        "--profile-length", "8"])  # fmt: skip
    assert set(r["ms"]) == {"forward", "forward_backward_no_dropout", "forward_backward_dropout",
                            "optimizer_update", "full_step"}  # fmt: skip
    assert all(v > 0 for v in r["ms"].values())


def test_torch_reference_times_the_same_model_against_the_same_peak(tmp_path):
    import jax

    out = tmp_path / "step.json"
    r = benchmark.main(["--model", "tiny", "--profile-step", "--batch-size", "2",
                        "--profile-length", "8", "--torch-reference", "--peak-sizes", "128,256",
                        "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    assert r["peak"]["n"] in (128, 256)
    config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64)  # fmt: skip
    ours = init_params(config, jax.random.key(0))
    ref = r["torch"]
    assert ref["parameters"] == sum(x.size for x in jax.tree.leaves(ours))  # the same shapes
    assert set(ref["ms"]) == {"forward", "full_step"} and all(v > 0 for v in ref["ms"].values())
    fwd = forward_flops(config, 2, 8)
    peak = r["peak"]["flops_per_s"]  # the machine's peak, measured by JAX, not torch's own
    seconds = {k: v / 1e3 for k, v in ref["ms"].items()}
    assert ref["share_of_peak"]["forward"] == pytest.approx(fwd / seconds["forward"] / peak)
    assert ref["share_of_peak"]["full_step"] == pytest.approx(3 * fwd / seconds["full_step"] / peak)
    assert ref["own_peak_flops_per_s"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "tiny", "--torch-reference"], "--torch-reference goes with --profile-step"),
        (
            ["--model", "tiny", "--profile-step", "--op-profile", "--torch-reference"],
            r"--profile-step \(alone\)",
        ),
        (["--model", "bert-huge"], "unknown --model 'bert-huge'; use minilm-l6 or one of"),
        (["--model", "tiny", "--lengths", "imdb"], "unknown --lengths 'imdb'; use rotten_tomatoes"),
    ],
)
def test_bad_arguments_are_user_errors(argv, message):  # __main__ prints them, exit status 2
    with pytest.raises(benchmark.UserError, match=message):
        benchmark.main(argv)


def test_tiny_packed_round_benchmark():
    r = benchmark.main(["--model", "tiny", "--clients", "2", "--examples-per-client", "8",
                        "--batch-size", "4", "--lengths", "16", "--repeats", "1", "--packing",
                        "--skip-baselines", "--chunk-size", "1"])  # fmt: skip
    config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64)  # fmt: skip
    # each batch: 4 examples x 16 tokens = a 64-token stream, no padding; attention on rows of
    # W = 64 slots, one more row than the 64 tokens need; 2 clients x 2 steps, stacked one step
    # at a time
    assert r["config"]["packing"] and r["padding_waste"] == 0.0
    assert r["machine"]["round_devices"] == 2  # one at a time, dealt to conftest's 2 devices
    assert r["config"]["segment_shapes"] == [[2, 1, 64], [2, 1, 64]]
    assert r["hardware_flops"] == 4 * 3 * packed_forward_flops(config, 64, 2, 64, 4)
    assert r["model_flops"] == 16 * train_step_flops(config, 1, 16)


def test_cudnn_attention_off_a_gpu_is_a_one_line_error_with_status_2(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "tools" / "benchmark.py"
    res = subprocess.run([sys.executable, str(script), "--model", "tiny", "--profile-step",
                          "--attention", "cudnn", "--dtype", "float32",
                          "--out", str(tmp_path / "b.json")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: --attention cudnn needs a GPU and --dtype bfloat16 (here: ")
    assert line.endswith(", float32); use --attention xla")
    assert not (tmp_path / "b.json").exists()


def test_op_breakdown_by_phase_and_kind():
    hlo = "\n".join([
        '  %dot.1 = f32[4,4]{1,0} dot(%a, %b), metadata={op_name="jit(f)/jvp(M)/q"}',
        '  %ynn_fusion.2 = f32[4,4]{1,0} fusion(%a), metadata={op_name="jit(f)/transpose(jvp(M))"}',
        '  %add_fusion = f32[4]{0} fusion(%a), metadata={op_name="jit(f)/add"}',
        '  %while.3 = (s32[]) while(%t), metadata={op_name="jit(f)/jvp(M)/_Dropout/while"}',
    ])  # fmt: skip
    ev = lambda name, us: {"ph": "X", "name": name, "dur": us}  # noqa: E731
    events = [ev("dot.1", 1000), ev("dot.1", 3000), ev("ynn_fusion.2", 2000),
              ev("add_fusion", 500), ev("while.3", 100), ev("ThunkExecutor::Execute", 9999),
              {"ph": "i", "name": "dot.1"}]  # fmt: skip
    r = benchmark.op_breakdown(events, hlo, steps=2)
    assert r["ms_per_step"] == {"forward matmul": 2.0, "backward matmul": 1.0,
                                "optimizer elementwise": 0.25, "forward loop": 0.05}  # fmt: skip
    assert [o["op"] for o in r["top_ops"]] == ["dot.1", "ynn_fusion.2", "add_fusion", "while.3"]


def test_tiny_op_profile_in_a_fresh_process():
    """XLA:CPU traces its ops only with a flag set before jax starts: the script sets it."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "tools" / "benchmark.py"
    out = subprocess.run([sys.executable, str(script), "--model", "tiny", "--op-profile",
                          "--batch-size", "2", "--profile-length", "8"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    r = json.loads(out)
    assert r["ms_per_step"]["forward matmul"] > 0 and r["ms_per_step"]["backward matmul"] > 0
    assert r["ms_per_step"]["optimizer elementwise"] > 0 and r["traced_step_ms"] > 0
