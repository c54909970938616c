"""Record oracle goldens: ``python3 -m tests.golden.record [--model tiny|qwen3.5-tiny-trained] [--only NAME ...] [--out DIR]``.

The oracle is transformers' ``Qwen3_5ForCausalLM`` (eager attention, bf16) on the tiny synthetic checkpoint
(``loader.synthetic.ensure_checkpoint("tiny")``; goldens in ``tests/golden``) or on the trained model's expanded
checkpoint (``--model qwen3.5-tiny-trained``; goldens in ``tests/golden/trained``) with the fp8 weights dequantised to bf16 up front
(``bf16(fp32(w) · fp32(scale_inv))``, transformers' own ``Fp8Dequantize`` rule; on a CPU-only machine
transformers 5.24 falls back to dequantising but, for this checkpoint layout, drops the scales, so we apply them).
For every prompt of ``prompts.json`` (chat template + tokenizer of the checkpoint) two paths are run under teacher
forcing: ``prefill`` (one forward over the prompt) and ``decode`` (first token alone, then one cached forward per
token). Stored per prompt in ``oracle_<name>.npz.xz`` (``assembler.ref.envelope.save_golden``; bf16 as uint16),
only what the tests read: top-32 ids/values at every position per path, argmax per path, the oracle's
self-disagreement d32 per position, and for STATE_PROMPTS of the synthetic checkpoint (the state test of
tests/cpu/test_ref_vs_oracle.py) the prefill path's final GDN recurrent (fp32)/conv state of layers STATE_LAYERS
and KV rows of layer KV_LAYER, with the oracle's largest prefill-vs-decode difference of each GDN state
(``self_rec<i>``, ``self_conv<i>``: the bound that test applies). ``manifest.json`` records versions, the
weight fingerprint, the largest full-vocabulary self-disagreement and the recurrent-state dtype seen in the cache.
Cost (measured 2026-11-29 on the shared 2-core CPU, 3 processes): ~15 min wall for the 9 prompts; use one torch thread (two threads ran ~30× slower per step under load).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from assembler.ref.envelope import GOLDEN_SUFFIX, save_golden
from assembler.ref.numerics import BF16

HERE = Path(__file__).resolve().parent
TOPK = 32
STATE_LAYERS = (0, 6)          # first and last GDN layer of the tiny preset
STATE_PROMPTS = ("prose",)     # GDN state / KV recorded for these prompts of the synthetic checkpoint only
KV_LAYER = 3


def weights_fingerprint(src) -> str:
    """sha256 over a few stored tensors of a WeightSource (detects a changed synthetic generator)."""
    h = hashlib.sha256()
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.linear_attn.in_proj_qkv.weight",
              "model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv", "model.layers.3.self_attn.q_proj.weight",
              "model.norm.weight", "model.layers.6.mlp.down_proj.weight"):
        a = np.ascontiguousarray(src.get(n))
        h.update(n.encode() + a[:4096].tobytes() + a[-4096:].tobytes())
    return h.hexdigest()[:16]


def prompt_ids(ckpt: Path) -> list[tuple[str, list[int]]]:
    from loader.chat_template import ChatTemplate
    from loader.tokenizer import Tokenizer
    ct, tk = ChatTemplate.from_checkpoint(ckpt), Tokenizer.from_checkpoint(ckpt)
    out = []
    for p in json.loads((HERE / "prompts.json").read_text())["prompts"]:
        text = ct.render(p["messages"], tools=p.get("tools"), add_generation_prompt=True,
                         enable_thinking=p.get("enable_thinking", True))
        out.append((p["name"], tk.encode(text)))
    return out


def checkpoint_of(model: str) -> Path:
    """Checkpoint directory of ``model``: ``tiny`` is the synthetic checkpoint (seed 0), a name of
    ``loader.trained.TRAINED`` the trained model's expanded checkpoint."""
    if model == "tiny":
        from loader.synthetic import ensure_checkpoint
        return ensure_checkpoint("tiny")
    from loader.trained import ensure_checkpoint
    return ensure_checkpoint(model)


def load_oracle(ckpt: Path):
    """transformers model on ``ckpt`` with every fp8 weight replaced by bf16(fp32(w)·fp32(scale))."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from loader.checkpoint import Checkpoint
    model = Qwen3_5ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="eager").eval()
    ck = Checkpoint.open(ckpt)
    params = dict(model.named_parameters())
    for n in ck.names():
        a = np.asarray(ck.get(n))
        if n.endswith(".weight_scale_inv") or n not in params:
            continue
        if n + "_scale_inv" in ck.names():
            s = np.asarray(ck.get(n + "_scale_inv")).astype(np.float32)
            w = a.astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:a.shape[0], :a.shape[1]]
            t = torch.from_numpy(w).to(torch.bfloat16)
        else:
            t = torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
        with torch.no_grad():
            params[n].copy_(t.reshape(params[n].shape))
    return model, ck


def _u16(t) -> np.ndarray:
    import torch
    return t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def _top(logits) -> tuple[np.ndarray, np.ndarray]:
    """top-32 by value, ties by lowest id (stable sort of −value)."""
    lf = logits.float().numpy()
    idx = np.argsort(-lf, axis=-1, kind="stable")[:, :TOPK]
    return idx.astype(np.int32), _u16(logits.gather(-1, __import__("torch").from_numpy(idx.astype(np.int64))))


def _states(cache, T: int, kv: bool = True) -> dict:
    out = {}
    for li in STATE_LAYERS:
        rec = cache.layers[li].recurrent_states[0]
        out[f"rec{li}"] = rec[0].float().numpy()
        out[f"conv{li}"] = _u16(cache.layers[li].conv_states[0][0, :, -3:])    # last 3 inputs, oldest first
    if kv:
        k, v = cache.layers[KV_LAYER].keys[0], cache.layers[KV_LAYER].values[0]   # [nkv, T, hd]
        rows = np.array([0, T // 2, T - 1])
        out["kv_rows"], out["k"], out["v"] = rows, _u16(k[:, rows].transpose(0, 1)), _u16(v[:, rows].transpose(0, 1))
    return out


def run_prompt(model, ids: list[int], states: bool = False) -> tuple[dict, dict]:
    """(the golden arrays of ``save_golden``, the manifest's facts about the run that are not stored as arrays);
    ``states``: record the GDN state / KV arrays too."""
    import torch
    from transformers import DynamicCache
    T = len(ids)
    x = torch.tensor([ids])
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        pre = model(input_ids=x, cache=cache, use_cache=True).logits[0]                  # [T, V] bf16
        rec = {"ids": np.array(ids, np.int32)}
        rec["pre_top_ids"], rec["pre_top_vals"] = _top(pre)
        rec["pre_argmax"] = np.argmax(pre.float().numpy(), -1).astype(np.int32)
        info = {"rec_dtype_prefill": str(cache.layers[STATE_LAYERS[0]].recurrent_states[0].dtype)}
        if states:
            rec.update({f"pre_{k}": v for k, v in _states(cache, T).items()})
        cache = DynamicCache(config=model.config)
        dec_rows = []
        for t in range(T):
            dec_rows.append(model(input_ids=x[:, t:t + 1], cache=cache, use_cache=True).logits[0, 0])
        dec = torch.stack(dec_rows)
        rec["dec_top_ids"], rec["dec_top_vals"] = _top(dec)
        rec["dec_argmax"] = np.argmax(dec.float().numpy(), -1).astype(np.int32)
        info["rec_dtype_decode"] = str(cache.layers[STATE_LAYERS[0]].recurrent_states[0].dtype)
        if states:
            for k, v in _states(cache, T, kv=False).items():
                f32 = (lambda a: a.view(BF16).astype(np.float32)) if k.startswith("conv") else (lambda a: a)
                rec[f"self_{k}"] = np.abs(f32(rec[f"pre_{k}"]) - f32(v)).max().astype(np.float32)
        pf, df = pre.float().numpy(), dec.float().numpy()
        info["self_dfull_max"] = float(np.abs(pf - df).max())                               # over positions and vocab
        rec["self_d32"] = np.abs(np.take_along_axis(df - pf, rec["pre_top_ids"].astype(np.int64), -1)).max(-1).astype(np.float32)
    return rec, info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="prompt names to record (default: all)")
    ap.add_argument("--out", default=None, help="default: tests/golden, or tests/golden/trained with --model")
    ap.add_argument("--model", default="tiny",
                    help="tiny (the synthetic checkpoint, seed 0) or a trained model of loader.trained")
    a = ap.parse_args(argv)
    import torch
    import transformers
    torch.set_num_threads(1)  # measured: 2 intra-op threads on a loaded 2-core host ran 30x slower per step
    ckpt = checkpoint_of(a.model)
    model, ck = load_oracle(ckpt)
    out = Path(a.out or (HERE if a.model == "tiny" else HERE / "trained"))
    out.mkdir(parents=True, exist_ok=True)
    man_p = out / "manifest.json"
    man = json.loads(man_p.read_text()) if man_p.is_file() else {"prompts": {}}
    man.update({"transformers": transformers.__version__, "torch": torch.__version__, "preset": a.model, "seed": 0,
                "weights_fingerprint": weights_fingerprint(ck), "attn_implementation": "eager",
                "dequant": "bf16(fp32(w) * fp32(scale_inv)) per 128x128 block, applied after from_pretrained"})
    for name, ids in prompt_ids(ckpt):
        if a.only and name not in a.only:
            continue
        t0 = time.time()
        rec, info = run_prompt(model, ids, states=a.model == "tiny" and name in STATE_PROMPTS)
        save_golden(out / f"oracle_{name}{GOLDEN_SUFFIX}", rec)
        agree = float(np.mean(rec["pre_argmax"] == rec["dec_argmax"]))
        man["prompts"][name] = {"tokens": len(ids), "self_top1_agreement": agree,
                                "self_d32_max": float(rec["self_d32"].max()), **info,
                                "seconds": round(time.time() - t0, 1)}
        print(name, man["prompts"][name], flush=True)
        man_p.write_text(json.dumps(man, indent=1) + "\n")


if __name__ == "__main__":
    main()
