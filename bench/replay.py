"""One DSA layer, fwd+bwd under activation recompute: stock (TileLang) vs HyScale, replay off/on.

The core attention is wrapped in ``tensor_parallel.checkpoint`` exactly as Megatron's selective
``core_attn`` recompute (and full recompute, per layer) does: the forward runs without grad, the
backward re-runs it with grad. Stock then selects twice; HyScale with replay selects once.
DeepSeek-V3.2 attention shapes: absorbed MLA (576 / 512), 16 heads (a TP shard of 128), indexer
64 x 128, top-2048, sparse indexer loss on (coeff 0.01). Random bf16 inputs, warm-up, medians.

On a GPU, from the repo root, with stock's TileLang installed (or the bundle bench/device_env.sh unpacks):
  python3 bench/replay.py --out $OUT              # appends its rows to bench/results/replay.csv
  python3 bench/plot_replay.py                    # bench/results/replay.png
CPU smoke (tiny shapes): python bench/replay.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _repo  # noqa: E402,F401  (registers hyscale_kernels / hyscale_patches from the checkout)
import torch  # noqa: E402
from common import append_csv, env_info, is_oom, markdown_table, peak_extra_bytes, time_ms  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--sizes", default="16384,32768,65536,131072")
p.add_argument("--variants", default="stock-tilelang,hyscale-noreplay,hyscale-replay")
p.add_argument("--heads", type=int, default=16)
p.add_argument("--no-ckpt", action="store_true", help="also time HyScale without recompute")
p.add_argument("--budget-s", type=float, default=480.0)
p.add_argument("--out", default=os.environ.get("OUT", "/tmp/replay_out"))
p.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "replay.csv"))
p.add_argument("--cpu-smoke", action="store_true")
p.add_argument("--model-sizes", default="", help="also time a small multi-layer GPT (full recompute) at these S")
p.add_argument("--model-layers", type=int, default=2)
args = p.parse_args()
T0 = time.time()
CPU = args.cpu_smoke or not torch.cuda.is_available()
DEV = "cpu" if CPU else "cuda"

from hyscale_megatron.env import init_single_process  # noqa: E402

init_single_process()
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.post_training.modelopt.layers import Linear  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.experimental_attention_variant import dsa as stock_dsa  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec, build_module  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402

from hyscale_megatron import replay  # noqa: E402
from hyscale_megatron.config import HyScaleConfig  # noqa: E402
from hyscale_megatron.dsa import HyScaleDSAttention  # noqa: E402

N = 2 if CPU else args.heads
HID, QLR = (64, 32) if CPU else (7168, 1536)
H_I, D_I, TOPK = (4, 32, 16) if CPU else (64, 128, 2048)
KV, ROPE = (32, 16) if CPU else (512, 64)
DTYPE = torch.float32 if CPU else torch.bfloat16
CALLS = {"select": 0}


def _count(mod, name):
    orig = getattr(mod, name)

    def wrapped(*a, **k):
        CALLS["select"] += 1
        return orig(*a, **k)

    setattr(mod, name, wrapped)


from hyscale_megatron import selection  # noqa: E402

_count(selection, "select_rows")
from hyscale_patches import dsa_dispatch  # noqa: E402


def build(variant: str):
    backend = "tilelang" if variant == "stock-tilelang" else "none"
    cfg = MLATransformerConfig(
        num_layers=1, hidden_size=HID, num_attention_heads=N, q_lora_rank=QLR, kv_lora_rank=KV,
        qk_head_dim=128 if not CPU else 16, qk_pos_emb_head_dim=ROPE, v_head_dim=128 if not CPU else 16,
        rope_type="rope", normalization="RMSNorm", add_bias_linear=False, experimental_attention_variant="dsa",
        dsa_indexer_n_heads=H_I, dsa_indexer_head_dim=D_I, dsa_indexer_topk=TOPK, dsa_indexer_loss_coeff=0.01,
        dsa_indexer_use_sparse_loss=True, dsa_indexer_rotate_activation=False, dsa_kernel_backend=backend,
        use_cpu_initialization=True, bf16=not CPU, params_dtype=DTYPE, hidden_dropout=0.0, attention_dropout=0.0)
    indexer = ModuleSpec(module=stock_dsa.DSAIndexer, submodules=stock_dsa.DSAIndexerSubmodules(
        linear_wq_b=Linear, linear_wk=Linear, k_norm=WrappedTorchNorm, linear_weights_proj=Linear))
    sub = stock_dsa.DSAttentionSubmodules(indexer=indexer)
    if variant.startswith("stock"):
        spec = ModuleSpec(module=stock_dsa.DSAttention, submodules=sub)
    else:
        hs = HyScaleConfig(replay=variant.endswith("-replay"))
        spec = ModuleSpec(module=HyScaleDSAttention, params={"hyscale": hs}, submodules=sub)
    m = build_module(spec, config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                     softmax_scale=(128 + 64) ** -0.5)
    return m.to(device=DEV, dtype=DTYPE).train()


def inputs(S, seed=7):
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, device=DEV, dtype=DTYPE, generator=g) * sc)  # noqa: E731
    query = r(S, 1, N, KV + ROPE).requires_grad_()
    key = r(S, 1, 1, KV + ROPE).requires_grad_()
    x, qr = r(S, 1, HID), r(S, 1, QLR)
    upv = r(N, 128 if not CPU else 16, KV, sc=0.05).requires_grad_()
    gout = r(S, 1, N * (128 if not CPU else 16))
    return query, key, x, qr, upv, gout


def make_step(m, tensors, ckpt: bool):
    query, key, x, qr, upv, gout = tensors

    def core(q_, k_, x_, qr_, u_):
        return m(q_, k_, None, None, x_, qr_, attn_mask_type=AttnMaskType.causal, up_v_weight=u_)

    def step():
        for t in (query, key, upv, *m.parameters()):
            t.grad = None
        out = tensor_parallel.checkpoint(core, False, query, key, x, qr, upv) if ckpt else core(query, key, x, qr, upv)
        out.backward(gout)
        replay.get_store().clear()

    return step


rows, results = [], []


def _save(row):
    """Append each measurement as soon as it exists: a run cut short still leaves its rows."""
    if not CPU:
        os.makedirs(args.out, exist_ok=True)
        append_csv(os.path.join(args.out, "replay.csv"), [row])

info = env_info()
variants = args.variants.split(",") + (["hyscale-replay-nockpt"] if args.no_ckpt else [])
sizes = [128, 256] if CPU else [int(s) for s in args.sizes.split(",")]
oomed = {}
for S in sizes:
    for variant in variants:
        if variant in oomed or time.time() - T0 > args.budget_s:
            results.append(dict(S=S, variant=variant, note=f"skipped ({'OOM at ' + str(oomed[variant]) if variant in oomed else 'time budget'})"))
            continue
        try:
            base = variant.replace("-nockpt", "")
            m = build(base)
            tensors = inputs(S)
            step = make_step(m, tensors, ckpt=not variant.endswith("-nockpt"))
            CALLS["select"] = 0
            t = time.time()
            step()
            first_s = time.time() - t
            sel_calls = CALLS["select"]
            replay.get_store().reset_peak()
            r = time_ms(step, warmup=1, min_iters=3, max_iters=10, target_ms=3000)
            peak = peak_extra_bytes(step)
            row = dict(kind="layer_fwd_bwd_recompute", S=S, variant=variant, heads=N, index_heads=H_I, topk=TOPK,
                       ms=r["ms"], p20=r["p20"], p80=r["p80"], iters=r["iters"], first_step_s=round(first_s, 2),
                       peak_extra_GiB=round(peak / 2**30, 3), hyscale_select_calls_per_step=sel_calls,
                       replay_peak_MiB=round(replay.store_stats()["peak_bytes"] / 2**20, 2), **info)
            rows.append(row)
            results.append(row)
            _save(row)
            print(f"[{time.time() - T0:6.1f}s] {variant:24s} S={S:7d} {r['ms']:9.2f} ms  peak {row['peak_extra_GiB']} GiB",
                  flush=True)
            del m, tensors, step
        except Exception as exc:  # noqa: BLE001
            if is_oom(exc):
                oomed[variant] = S
            else:
                traceback.print_exc()
            results.append(dict(S=S, variant=variant, note=f"{type(exc).__name__}: {str(exc)[:160]}"))
        if not CPU:
            torch.cuda.empty_cache()



def build_model(variant: str):
    """A small GPT with real DSA attention shapes (hidden 2048, MLA 576/512, indexer 64x128, top-2048)."""
    from hyscale_megatron.env import seed_all
    from hyscale_megatron.models import build_gpt, mla_dsa_config

    kw = dict(num_layers=args.model_layers, recompute_granularity="full", recompute_method="uniform",
              recompute_num_layers=1, dsa_kernel_backend="tilelang" if variant == "stock-tilelang" else "none")
    if not CPU:
        kw.update(hidden_size=2048, ffn_hidden_size=4096, num_attention_heads=N, q_lora_rank=QLR, kv_lora_rank=KV,
                  qk_head_dim=128, qk_pos_emb_head_dim=ROPE, v_head_dim=128, dsa_indexer_n_heads=H_I,
                  dsa_indexer_head_dim=D_I, dsa_indexer_topk=TOPK, use_cpu_initialization=False)
    stock_dsa.DSAIndexerLossLoggingHelper.tracker.clear()  # sized by num_layers on first use
    seed_all(3)
    cfg = mla_dsa_config(dtype=DTYPE, **kw)
    hs = HyScaleConfig(replay=variant.endswith("-replay"))
    m = build_gpt(cfg, use_hyscale=not variant.startswith("stock"), hyscale=hs, vocab_size=4096, max_seq=1 << 21)
    return m.to(DEV).train()


for S in ([64] if CPU and args.model_sizes else [int(s) for s in args.model_sizes.split(",") if s]):
    for variant in args.variants.split(","):
        if time.time() - T0 > args.budget_s:
            results.append(dict(S=S, variant="model-" + variant, note="skipped (time budget)"))
            continue
        try:
            m = build_model(variant)
            g = torch.Generator(device=DEV).manual_seed(1)
            tokens = torch.randint(0, 4096, (1, S), device=DEV, generator=g)
            pos = torch.arange(S, device=DEV)[None]

            def mstep():
                m.zero_grad(set_to_none=True)
                m(tokens, pos, None, labels=tokens.roll(-1, 1)).float().mean().backward()
                replay.get_store().clear()
                stock_dsa.DSAIndexerLossLoggingHelper.clean_loss_in_tracker()

            CALLS["select"] = 0
            mstep()
            sel = CALLS["select"]
            r = time_ms(mstep, warmup=1, min_iters=3, max_iters=8, target_ms=3000)
            peak = peak_extra_bytes(mstep)
            row = dict(kind="gpt_fwd_bwd_full_recompute", S=S, variant="model-" + variant, layers=args.model_layers,
                       heads=N, index_heads=H_I, topk=TOPK, ms=r["ms"], p20=r["p20"], p80=r["p80"], iters=r["iters"],
                       peak_extra_GiB=round(peak / 2**30, 3), hyscale_select_calls_per_step=sel, **info)
            rows.append(row)
            results.append(row)
            _save(row)
            print(f"[{time.time() - T0:6.1f}s] model {variant:18s} S={S:7d} {r['ms']:9.2f} ms", flush=True)
            del m
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                traceback.print_exc()
            results.append(dict(S=S, variant="model-" + variant, note=f"{type(exc).__name__}: {str(exc)[:160]}"))
        if not CPU:
            torch.cuda.empty_cache()

by = {(r["S"], r["variant"]): r for r in results if "ms" in r}
for r in results:
    prefix = "model-" if r["variant"].startswith("model-") else ""
    st = by.get((r["S"], prefix + "stock-tilelang"))
    if "ms" in r and st:
        r["speedup_vs_stock"] = round(st["ms"] / r["ms"], 2)
    nr = by.get((r["S"], prefix + "hyscale-noreplay"))
    if "ms" in r and nr and r["variant"] == prefix + "hyscale-replay":
        r["replay_saves_ms"] = round(nr["ms"] - r["ms"], 1)
os.makedirs(args.out, exist_ok=True)
if not CPU:
    append_csv(args.csv, rows)
tbl = markdown_table(results, ["S", "variant", "ms", "p20", "p80", "peak_extra_GiB", "speedup_vs_stock",
                               "replay_saves_ms", "hyscale_select_calls_per_step", "note"])
with open(os.path.join(args.out, "replay_table.md"), "w") as f:
    f.write(tbl + "\n")
print("\n" + tbl)
