"""hyscale-train: its help, one-line answers to bad flags, the flags' effect (spec choice, config files,
Megatron defaults), the pieces it hands Megatron's pretrain, and its metrics. Training itself runs
in test_compare.py's real comparison (both back-end runs, in subprocesses)."""

import json
import math
import os
import sys

import pytest
import torch
from _tools import FAST, ROOT, TINY, error_lines

from hyscale_megatron.tools import train

pytestmark = pytest.mark.usefixtures("megatron_env")


@pytest.fixture(autouse=True)
def _unset_megatron_globals():
    yield
    from megatron.training import global_vars

    global_vars.unset_global_variables()


@pytest.fixture
def keep_env(monkeypatch):
    """hyscale-train's main may set TORCH_EXTENSIONS_DIR: undo it after the test."""
    prev = os.environ.get("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", prev or "")  # records the state to restore
    if prev is None:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR")


# ----------------------------------------------------------------------------- help
def test_help_lists_hyscale_flags_first(capsys):
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "usage: hyscale-train [@FILE ...] [FLAGS ...]"
    assert lines.index("hyscale:") < 10 < lines.index("network size:"), "HyScale's group comes first"
    assert "--hyscale-topk-impl" in out and "--help-hyscale" in out
    assert "(e.g. 1.10 = 10%)" in out, "megatron-core's literal percent sign is printed, not a format error"


def test_help_hyscale_prints_only_ours(capsys):
    assert train.main(["--help-hyscale"]) == 0
    out = capsys.readouterr().out
    assert "--hyscale-replay-offload" in out and "--hyscale-metrics-file" in out
    assert "--num-layers" not in out and len(out.splitlines()) < 100


# ----------------------------------------------------------------------------- bad flags: one line, exit 2
@pytest.mark.parametrize("flags,msg", [
    (["--hyscale-topk-impl", "bogus"], "HyScaleConfig.topk_impl='bogus' is invalid; choose one of auto, triton"),
    (["--hyscale-replay-offload", "--no-hyscale-replay"], "replay_offload=True needs replay=True"),
    (["--num-layerz", "2"], "unrecognized arguments: --num-layerz 2"),
    (["--train-iters", "0"], "--train-iters must be >= 1, got 0"),
    (["--global-batch-size", "3", "--micro-batch-size", "2"], "Megatron's argument validation refuses the flags"),
])
def test_bad_flags_are_one_line(flags, msg, capsys, monkeypatch, keep_env):
    monkeypatch.setattr(train, "run_core_loop", lambda args: pytest.fail("nothing may train"))
    monkeypatch.setattr(train, "run_pretrain", lambda args: pytest.fail("nothing may train"))
    assert train.main([TINY, *flags]) == 2
    err = capsys.readouterr().err
    lines = error_lines(err, "hyscale-train")
    assert len(lines) == 1 and msg in lines[0], err
    assert "Traceback" not in err and "usage:" not in err
    with pytest.raises(train.UsageError, match="does not exist"):
        train.expand_arg_files(["@/nonexistent/file.args"])


def test_topk_not_smaller_than_the_sequence_is_noted(capsys, monkeypatch, keep_env):
    ran = []
    monkeypatch.setattr(train, "run_core_loop", ran.append)
    monkeypatch.setattr(train, "run_pretrain", ran.append)
    assert train.main([TINY, "--dsa-indexer-topk", "100000"]) == 0 and len(ran) == 1
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "note:" in ln]
    assert notes == ["hyscale-train: note: --dsa-indexer-topk 100000 is not smaller than --seq-length 256: every "
                     "query selects all of its causal keys (dense attention through the sparse path)"]
    assert train.topk_note(32, 256) is None and train.topk_note(256, 256) is not None


def test_torch_extensions_dir_defaults_to_the_venv(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    train.use_venv_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/mine")
    train.use_venv_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/mine", "a folder the user chose is kept"
    monkeypatch.setattr(sys, "base_prefix", str(tmp_path))  # not a virtual environment: torch's default
    assert train.venv_extensions_dir() is None


# ----------------------------------------------------------------------------- what the flags choose
def test_expand_arg_files(tmp_path):
    inner = tmp_path / "inner.args"
    inner.write_text("--b 2  # comment\n--name 'two words'\n")
    outer = tmp_path / "outer.args"
    outer.write_text(f"# model\n--a 1\n@{inner}\n")
    assert train.expand_arg_files(["--x", f"@{outer}", "--y"]) == ["--x", "--a", "1", "--b", "2", "--name",
                                                                  "two words", "--y"]


@pytest.mark.parametrize("flags,spec,run", [
    (["--hyscale"], "hyscale_block_spec", "hyscale"),
    (["--no-hyscale"], "stock_block_spec", "stock"),
    ([], "hyscale_block_spec", "hyscale"),
    (["--spec", "hyscale_megatron.specs", "stock_block_spec"], "stock_block_spec", "stock"),
])
def test_parse_chooses_spec(flags, spec, run):
    args = train.parse_train_args([TINY, *flags])
    assert args.spec == ["hyscale_megatron.specs", spec]
    assert args.hyscale_run_name == run
    assert args.mock_data and args.experimental_attention_variant == "dsa"
    assert train.choose_backend(args) == ("pretrain" if torch.cuda.is_available() else "core-loop")


def test_eval_interval_defaults_for_pretrain():
    """Megatron 0.19.2's pretrain computes train_iters // eval_interval: it must not stay None."""
    assert train.parse_train_args([TINY, "--train-iters", "7"]).eval_interval == 7
    assert train.parse_train_args([TINY, "--eval-interval", "3"]).eval_interval == 3


@pytest.mark.parametrize("name", ["tiny_cpu", "deepseek_v32_1gpu", "deepseek_v32_longest", "glm51_1gpu",
                                  "deepseek_v32_multigpu", "glm51_multigpu"])
def test_configs_parse_with_megatron(name):
    extra = [] if "1gpu" in name or name in ("tiny_cpu", "deepseek_v32_longest") else [
        "--transformer-impl", "local", "--mock-data", "--seq-length", "4096", "--max-position-embeddings", "4096",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "5"]
    args = train.parse_train_args([f"@{ROOT / 'configs' / (name + '.args')}", *extra])
    assert args.experimental_attention_variant == "dsa" and args.multi_latent_attention
    if name != "tiny_cpu":
        assert args.dsa_indexer_topk == 2048 and args.dsa_indexer_head_dim == 128 and args.kv_lora_rank == 512
        assert args.qk_pos_emb_head_dim == 64
        # the longest-sequence config keeps one TP-8 shard of DeepSeek-V3.2's 128 heads
        assert (args.num_attention_heads, args.dsa_indexer_n_heads) in ((128, 64), (64, 32), (16, 64))
        assert args.dsa_indexer_rope_interleaved == name.startswith("glm")
    assert not args.create_attention_mask_in_dataloader, "a [S, S] mask per sample: 4 GiB at 64K"


def test_launch_scripts_differ_only_in_spec_and_hyscale_flags():
    stock = (ROOT / "examples" / "launch_stock.sh").read_text().splitlines()
    ours = (ROOT / "examples" / "launch_hyscale.sh").read_text().splitlines()
    assert len(stock) == len(ours)
    diff = [(a, b) for a, b in zip(stock, ours) if a != b]
    assert [a.split("=")[0] for a, _ in diff] == ["SPEC", "HYSCALE_ARGS"]
    assert "stock_block_spec" in diff[0][0] and "hyscale_block_spec" in diff[0][1]
    assert diff[1][0] == 'HYSCALE_ARGS="--no-hyscale"' and "--hyscale " in diff[1][1]
    assert "-m hyscale_megatron.tools.train" in "\n".join(ours)


def test_core_loop_refuses_tied_embeddings_with_pp():
    args = train.parse_train_args([TINY, *FAST])
    args.pipeline_model_parallel_size = 2
    args.untie_embeddings_and_output_weights = False
    with pytest.raises(train.UsageError, match="untie-embeddings"):
        train._check_core_loop_args(args)


# ----------------------------------------------------------------------------- Megatron's pretrain back-end
def test_pretrain_adapter_pieces_on_cpu(monkeypatch):
    """run_pretrain hands Megatron's pretrain a config whose GPTModelBuilder builds our spec, and the
    dataset provider / forward_step it receives produce a finite loss (pretrain itself needs CUDA)."""
    import megatron.training
    from megatron.core.process_groups_config import ProcessGroupCollection

    from hyscale_megatron import runtime

    args = train.parse_train_args([TINY, *FAST, "--hyscale", "--no-hyscale-replay"])
    captured = {}

    def fake_pretrain(cfg, datasets_provider, model_type, forward_step_func, **kw):
        captured.update(cfg=cfg, datasets=datasets_provider, forward=forward_step_func)

    monkeypatch.setattr(megatron.training, "pretrain", fake_pretrain)
    train.run_pretrain(args)
    assert runtime.current_config().replay is False, "flags must reach runtime.set_config before the build"
    cfg = captured["cfg"]
    model = cfg.model.get_builder_cls()(cfg.model).build_model(ProcessGroupCollection.use_mpu_process_groups())
    assert train.core_attention_kinds(model) == {"HyScaleDSAttention": 2}
    assert captured["datasets"].is_distributed
    train_ds, _, _ = captured["datasets"]([2, 0, 0])
    sample = train_ds[0]
    assert sample["tokens"].shape == (128,)
    batch = iter([{k: v.unsqueeze(0) for k, v in sample.items()}])
    output, loss_fn = captured["forward"](batch, model)
    loss, n, report = loss_fn(output)
    assert math.isfinite(loss.item()) and int(n) == 128 and report["lm loss"].shape == (2,)


# ----------------------------------------------------------------------------- metrics and schedule
def test_metrics_train_step_wrapper(tmp_path):
    args = train.parse_train_args([TINY, *FAST, "--hyscale-metrics-file", str(tmp_path / "m.jsonl")])

    def fake_train_step(*a, **k):
        return ({"lm loss": torch.tensor(2.5)}, False, False, False, 0, 1.0, None)

    wrapped = train._metrics_train_step(fake_train_step, args)
    out = wrapped()
    assert out[0]["lm loss"].item() == 2.5
    rec = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
    assert rec["run"] == "hyscale" and rec["lm_loss"] == 2.5 and rec["step_ms"] > 0 and rec["peak_mem_bytes"] > 0


def test_log_line_shows_replay_store_bytes():
    rec = dict(iteration=3, consumed_samples=3, step_ms=12.0, tokens_per_s=100.0, lr=1e-3, global_batch_size=1,
               lm_loss=4.0, indexer_loss=1e-6, peak_mem_bytes=2**30, replay_store_bytes=3 * 2**20)
    line = train.format_log_line(rec, 10)
    assert "replay store peak (MB): 3.00" in line and "lm loss: 4.000000E+00" in line
    assert "replay store" not in train.format_log_line(dict(rec, replay_store_bytes=0), 10)


def test_lr_schedule():
    class A:
        lr, min_lr, lr_warmup_iters, lr_decay_iters, train_iters, lr_decay_style = 1.0, 0.1, 2, None, 12, "cosine"

    a = A()
    assert train._lr_at(a, 1) == pytest.approx(0.5)
    assert train._lr_at(a, 2) == pytest.approx(1.0)
    assert train._lr_at(a, 12) == pytest.approx(0.1)
    a.lr_decay_style = "constant"
    assert train._lr_at(a, 7) == 1.0
