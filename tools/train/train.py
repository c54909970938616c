"""Train the small Qwen3.5 (the ``tiny`` preset's shape) with its MTP head on the corpus of ``tools.train.corpus``.

    python3 -m tools.train.train --corpus DIR --out DIR [--seconds 400] [--device cuda]

Model: transformers' ``Qwen3_5ForCausalLM`` built from ``loader.synthetic.config_json(preset("tiny"))`` (hidden
256, 8 layers LLLF LLLF, GDN + gated attention) with a compact tied vocabulary of ``--vocab`` rows: the
``K - 2`` most frequent training ids (every added token included), row ``K - 2`` shared by every other text id
and row ``K - 1`` (fixed at zero) standing for the 243 padding ids. Each shared row's logit carries
``+log(count of ids it stands for)``, so the compact softmax is the full 248,320-row softmax of the exported
checkpoint (whose rare rows all equal the shared row and whose padding rows are zero) marginalised exactly;
reported losses add ``log(n_other)`` for a rare target, i.e. they are full-vocabulary nats/token.

MTP (spec §4, ``assembler/ref/mtp.py``): ``x = fc(cat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)])``
with ``h_t`` the main model's final-normed hidden state, one full-attention ``Qwen3_5DecoderLayer`` at position t,
``norm``, the shared lm_head → token t+2. Parameter names are the checkpoint's ``mtp.*`` names.
Loss = CE(main, t+1) + ``mtp_w`` · CE(MTP, t+2) + ``kd_w`` · KL(main's detached t+1 distribution ‖ MTP).

Evaluation on the validation splits (code, docs, tools): main loss, MTP loss, MTP top-1 agreement with the
main model's argmax (α1, exact: teacher-forced step 1 is the real draft step) and the chained α2..α7
(approximation: step k runs causally over the step-k rows, so its keys are the step-k rows', where the engine's
MTP cache holds step-1 keys for earlier positions), each in bf16 autocast three ways: the trained weights
(bf16-rounded), after the fp8 export of the body (128×128 block e4m3, bf16 scales, the checkpoint's rule), and
with the embedding/lm_head as the artefact stores it too (e4m3 with a power-of-two scale per row, exact in bf16).

Writes into ``--out``: ``body_<i>.npz`` (shards of ≤ 12 MiB holding every non-embedding tensor by canonical checkpoint name, stored bits: uint8
e4m3 and uint16 bf16 incl. ``*_scale_inv``), ``embed.npz`` (``ids`` int32 [K-2] full ids of the compact rows,
``embed_e4m3`` uint8 [K, H], ``embed_exp`` int8 [K] power-of-two row scales), ``train_log.json``.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from loader.config import preset
from loader.synthetic import config_json

FULL_VOCAB, FIRST_ADDED, FIRST_PAD = 248320, 248044, 248077
N_PAD = FULL_VOCAB - FIRST_PAD
BODY_SHARD_BYTES = 12 << 20


def hf_config(vocab: int, text_config: Path | None = None):
    """transformers config of the tiny preset with a ``vocab``-row tied vocabulary, from ``text_config``
    (the corpus's ``text_config.json``) or, when None, from ``loader``."""
    from transformers import Qwen3_5TextConfig  # deferred: the heavy oracle package, loaded where a model is built
    if text_config is not None:
        tc = json.loads(Path(text_config).read_text())
    else:
        tc = dict(config_json(preset("tiny"))["text_config"])
    tc.pop("quantization_config", None)
    tc.update(vocab_size=vocab, tie_word_embeddings=True, use_cache=False)
    cfg = Qwen3_5TextConfig(**tc)
    cfg._attn_implementation = "sdpa"
    return cfg


class MTP(nn.Module):
    """The MTP head; submodule names map one-to-one onto the checkpoint's ``mtp.*`` tensors."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer,  # deferred, as in hf_config
                                                                  Qwen3_5RMSNorm)
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        mc = copy.deepcopy(cfg)
        mc.layer_types = ["full_attention"]
        mc.num_hidden_layers = 1
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(mc, layer_idx=0)])
        self.norm = Qwen3_5RMSNorm(H, eps)

    def forward(self, e, h, pos_emb):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], dim=-1))
        out = self.layers[0](x, position_embeddings=pos_emb, attention_mask=None)
        x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)


class Net(nn.Module):
    def __init__(self, cfg, K: int, n_other: int):
        super().__init__()
        from transformers import Qwen3_5ForCausalLM  # deferred, as in hf_config
        self.lm = Qwen3_5ForCausalLM(cfg)
        self.mtp = MTP(cfg)
        self.K = K
        bias = torch.zeros(K)
        bias[K - 2], bias[K - 1] = math.log(n_other), math.log(N_PAD)
        self.register_buffer("bias", bias)
        with torch.no_grad():
            self.lm.model.embed_tokens.weight[K - 1].zero_()

    def head(self):
        E = self.lm.model.embed_tokens.weight
        return torch.cat([E[: self.K - 1], torch.zeros_like(E[:1])])  # the padding row stays zero

    def logits(self, h, W):
        return F.linear(h, W.to(h.dtype)) + self.bias.to(h.dtype)

    def rope(self, h, T: int, offset: int = 0):
        pos = (torch.arange(T, device=h.device) + offset).view(1, 1, -1).expand(3, h.shape[0], -1)
        return self.lm.model.rotary_emb(h, pos)

    def forward(self, x):
        """x [B, T+2] compact ids → (main logits [B, T+1, K] for x[:, 1:], mtp logits [B, T, K] for x[:, 2:],
        final-normed hidden [B, T+1, H], mtp-normed hidden [B, T, H])."""
        T = x.shape[1] - 2
        h = self.lm.model(input_ids=x[:, : T + 1]).last_hidden_state
        W = self.head()
        lm = self.logits(h, W)
        e = self.lm.model.embed_tokens(x[:, 1: T + 1])
        hm = self.mtp(e, h[:, :T], self.rope(h, T))
        return lm, self.logits(hm, W), h, hm


def build_vocab(train: np.ndarray, K: int):
    counts = np.bincount(train, minlength=FULL_VOCAB)
    counts[FIRST_ADDED:FIRST_PAD] += 1 << 40  # every added token gets a row
    counts[FIRST_PAD:] = -1
    keep = np.sort(np.argsort(-counts, kind="stable")[: K - 2])
    full2c = np.full(FULL_VOCAB, K - 2, dtype=np.int64)
    full2c[keep] = np.arange(K - 2)
    full2c[FIRST_PAD:] = K - 1
    n_other = FIRST_PAD - (K - 2)
    return keep.astype(np.int32), full2c, n_other


# ------------------------------------------------------------------------------------------------ export rules
def e4m3_blocks(w: torch.Tensor):
    """128×128 block quantisation (spec §5): s = amax/448 stored bf16, q = e4m3(w / s). Returns (q e4m3, s bf16)."""
    R, C = w.shape
    wb = w.float().reshape(R // 128, 128, C // 128, 128)
    amax = wb.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    s = (amax / 448.0).to(torch.bfloat16)
    q = (wb / s.float()[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(R, C)
    return q, s


def e4m3_blocks_deq(q, s):
    R, C = q.shape
    return (q.float().reshape(R // 128, 128, C // 128, 128) * s.float()[:, None, :, None]).reshape(R, C)


def e4m3_rows(E: torch.Tensor):
    """Per-row e4m3 with a power-of-two scale 2^k, k = ceil(log2(amax/448)): exact in bf16 after dequantising."""
    amax = E.float().abs().amax(dim=1).clamp_min(1e-30)
    k = torch.ceil(torch.log2(amax / 448.0)).clamp(-126, 127)
    q = (E.float() / torch.exp2(k)[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, k.to(torch.int8)


FP8_SUFFIXES = ("in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight", "q_proj.weight", "k_proj.weight",
                "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def is_fp8(name: str, p: torch.Tensor) -> bool:
    """Whether the checkpoint stores ``name`` as block-scaled e4m3 (spec §5's list)."""
    return p.ndim == 2 and name.endswith(FP8_SUFFIXES)


def export_state(net: Net):
    """(canonical name → tensor as the checkpoint stores it, name → dequantised fp32 tensor) for the body."""
    stored, deq = {}, {}
    for prefix, mod in (("", net.lm), ("mtp.", net.mtp)):
        for n, p in mod.named_parameters():
            name = prefix + n
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                continue
            if is_fp8(name, p):
                q, s = e4m3_blocks(p.detach())
                stored[name], stored[name + "_scale_inv"] = q, s
                deq[name] = e4m3_blocks_deq(q, s)
            else:
                b = p.detach().to(torch.bfloat16)
                stored[name], deq[name] = b, b.float()
    return stored, deq


# ------------------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(net: Net, vals: dict, full2c: np.ndarray, n_other: int, T: int, max_tokens: int, dev, chain: int = 7):
    net.eval()
    out = {}
    rare_pen = math.log(n_other)
    for split, ids in vals.items():
        n = min(len(ids), max_tokens + 2)
        x = torch.from_numpy(full2c[ids[:n]]).to(dev)
        nw = (n - 2) // (T + 2) or 1
        L = min(T + 2, n)
        tot = {"main": 0.0, "mtp": 0.0, "n": 0, "acc": np.zeros(chain), "cum": np.zeros(chain), "m": np.zeros(chain)}
        for w in range(nw):
            xb = x[w * L: (w + 1) * L][None]
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                lm, lmt, h, hm = net(xb)
            lm, lmt = lm.float(), lmt.float()
            tgt, tgt2 = xb[:, 1:], xb[:, 2:]
            ce = F.cross_entropy(lm.flatten(0, 1), tgt.flatten(), reduction="none") + (tgt.flatten() == net.K - 2) * rare_pen
            ce2 = F.cross_entropy(lmt.flatten(0, 1), tgt2.flatten(), reduction="none") + (tgt2.flatten() == net.K - 2) * rare_pen
            tot["main"] += ce.sum().item()
            tot["mtp"] += ce2.sum().item()
            tot["n"] += tgt.numel()
            g = lm.argmax(-1)[0]  # main argmax at position j predicts x[j+1]
            Tm = lmt.shape[1]
            ok = (lmt.argmax(-1)[0] == g[1: Tm + 1])  # draft 1 at row i vs main argmax at i+1
            cum = ok.clone()
            tot["acc"][0] += ok.float().sum().item()
            tot["cum"][0] += cum.float().sum().item()
            tot["m"][0] += ok.numel()
            hk = hm
            W = net.head()
            for k in range(2, chain + 1):
                R = Tm - (k - 1)
                if R <= 0:
                    break
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    e = net.lm.model.embed_tokens(xb[:, k: k + R])
                    hk = net.mtp(e, hk[:, :R], net.rope(hk, R, offset=k - 1))
                    dk = net.logits(hk, W).argmax(-1)[0]
                okk = dk == g[k: k + R]
                cum = cum[:R] & okk
                tot["acc"][k - 1] += okk.float().sum().item()
                tot["cum"][k - 1] += cum.float().sum().item()
                tot["m"][k - 1] += R
        m = np.maximum(tot["m"], 1)
        out[split] = {"tokens": tot["n"], "main_loss": tot["main"] / tot["n"], "mtp_loss": tot["mtp"] / tot["n"],
                      "alpha_step": (tot["acc"] / m).round(4).tolist(), "alpha_cum": (tot["cum"] / m).round(4).tolist()}
    net.train()
    return out


def load_state(net: Net, deq: dict, embed: torch.Tensor | None):
    with torch.no_grad():
        for prefix, mod in (("", net.lm), ("mtp.", net.mtp)):
            for n, p in mod.named_parameters():
                if prefix + n in deq:
                    p.copy_(deq[prefix + n].to(p.dtype))
        if embed is not None:
            net.lm.model.embed_tokens.weight.copy_(embed)


def to_bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.float8_e4m3fn:
        return t.cpu().view(torch.uint8).numpy()
    if t.dtype == torch.bfloat16:
        return t.cpu().view(torch.int16).numpy().view(np.uint16)
    return t.cpu().numpy()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="train the small Qwen3.5 + MTP head")
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=400.0, help="training wall-clock budget (evaluation excluded)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2046, help="T: main forward T+1 tokens, windows of T+2")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--mtp-w", type=float, default=0.3)
    ap.add_argument("--kd-w", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--eval-tokens", type=int, default=65536, help="per validation split")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    dev = torch.device(a.device)
    data = np.load(a.corpus / "corpus.npz")
    train = np.concatenate([data["train_code"], data["train_docs"], data["train_tools"]])
    vals = {s: data[f"val_{s}"] for s in ("code", "docs", "tools")}
    keep, full2c, n_other = build_vocab(train, a.vocab)
    cover = {s: float(np.mean(full2c[v] < a.vocab - 2)) for s, v in vals.items()}
    trainc = torch.from_numpy(full2c[train]).to(dev)
    tcj = a.corpus / "text_config.json"
    cfg = hf_config(a.vocab, tcj if tcj.is_file() else None)
    net = Net(cfg, a.vocab, n_other).to(dev)
    n_params = sum(p.numel() for p in net.parameters())
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda")
    T, B, W = a.seq, a.batch, a.seq + 2
    total_steps = a.max_steps or 10 ** 9
    curve, t0, step, t_meas = [], time.perf_counter(), 0, None

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        p = min(1.0, (s - a.warmup) / max(1, total_steps - a.warmup))
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    net.train()
    while step < total_steps:
        starts = torch.from_numpy(rng.integers(0, len(train) - W, size=B)).to(dev)
        xb = trainc[starts[:, None] + torch.arange(W, device=dev)[None]]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            lm, lmt, _, _ = net(xb)
            l_main = F.cross_entropy(lm.flatten(0, 1).float(), xb[:, 1:].flatten())
            l_mtp = F.cross_entropy(lmt.flatten(0, 1).float(), xb[:, 2:].flatten())
            teach = F.log_softmax(lm[:, 1:].detach().float(), -1)
            l_kd = F.kl_div(F.log_softmax(lmt.float(), -1).flatten(0, 1), teach.flatten(0, 1), log_target=True,
                            reduction="batchmean")
            loss = l_main + a.mtp_w * l_mtp + a.kd_w * l_kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 5:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_meas = time.perf_counter()
        if step == 25 and a.max_steps is None:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per = (time.perf_counter() - t_meas) / 20
            total_steps = max(a.warmup + 10, int((a.seconds - (time.perf_counter() - t0)) / per) + 25)
            print(f"step time {per * 1e3:.1f} ms, {B * W / per / 1e3:.0f}k tok/s -> {total_steps} steps", flush=True)
        if step % 25 == 0 or step == 1 or step == total_steps:
            row = {"step": step, "t": round(time.perf_counter() - t0, 1), "lr": lr_at(step - 1),
                   "loss": round(float(loss.detach()), 4), "main": round(float(l_main.detach()), 4),
                   "mtp": round(float(l_mtp.detach()), 4), "kd": round(float(l_kd.detach()), 4)}
            curve.append(row)
            print(json.dumps(row), flush=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    ev = {}
    t1 = time.perf_counter()
    stored, deq = export_state(net)
    bf16 = {n: (v.float() if v.dtype == torch.bfloat16 else None) for n, v in stored.items()}
    master = {n: p.detach().clone() for n, p in net.state_dict().items()}
    E = net.lm.model.embed_tokens.weight.detach().clone()
    E[a.vocab - 1] = 0
    # bf16: every trained tensor rounded to bf16 (what an unquantised bf16 export would hold)
    bf_all = {}
    for prefix, mod in (("", net.lm), ("mtp.", net.mtp)):
        for n, p in mod.named_parameters():
            bf_all[prefix + n] = p.detach().to(torch.bfloat16).float()
    load_state(net, bf_all, None)
    ev["bf16"] = evaluate(net, vals, full2c, n_other, T, a.eval_tokens, dev)
    print("eval bf16", json.dumps(ev["bf16"]), flush=True)
    load_state(net, deq, E.to(torch.bfloat16).float())
    ev["fp8_body"] = evaluate(net, vals, full2c, n_other, T, a.eval_tokens, dev)
    print("eval fp8 body", json.dumps(ev["fp8_body"]), flush=True)
    qE, kE = e4m3_rows(E)
    E8 = qE.float() * torch.exp2(kE.float())[:, None]
    assert torch.equal(E8.to(torch.bfloat16).float(), E8), "row-scaled e4m3 must be exact in bf16"
    load_state(net, deq, E8)
    ev["fp8_all"] = evaluate(net, vals, full2c, n_other, T, a.eval_tokens, dev)
    print("eval fp8 all (artefact)", json.dumps(ev["fp8_all"]), flush=True)
    net.load_state_dict(master)
    del bf16
    a.out.mkdir(parents=True, exist_ok=True)
    shards, cur, size = [], {}, 0
    for n, v in stored.items():  # shards under the device's 16 MiB per-file limit on what comes back
        b = to_bits(v)
        if cur and size + b.nbytes > BODY_SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[n], size = b, size + b.nbytes
    shards.append(cur)
    for i, sh in enumerate(shards):
        np.savez_compressed(a.out / f"body_{i}.npz", **sh)
    np.savez_compressed(a.out / "embed.npz", ids=keep, embed_e4m3=to_bits(qE), embed_exp=kE.cpu().numpy())
    import transformers  # deferred, as in hf_config
    log = {"seed": a.seed, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "cuda": torch.version.cuda, "numpy": np.__version__,
                        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"},
           "params": n_params, "vocab": {"compact_rows": a.vocab, "n_other": n_other, "n_pad": N_PAD,
                                         "val_coverage": cover},
           "train_tokens": int(len(train)), "steps": step, "tokens_seen": step * B * W, "train_seconds": round(train_s, 1),
           "tokens_per_s": round(step * B * W / train_s), "eval_seconds": round(time.perf_counter() - t1, 1),
           "total_seconds": round(time.perf_counter() - t_start, 1), "curve": curve, "eval": ev,
           "corpus_manifest_sha256": __import__("hashlib").sha256((a.corpus / "manifest.json").read_bytes()).hexdigest()}
    (a.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps({k: log[k] for k in ("steps", "tokens_per_s", "train_seconds", "total_seconds")}), flush=True)


if __name__ == "__main__":
    main()
