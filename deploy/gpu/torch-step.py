#!/usr/bin/env python3
"""PyTorch eager on the shapes gpu-bench times: the comparison for the engine's GPU step.

Random fp16 weights of a Qwen2.5 shape (dense: PyTorch has no GGUF block formats), a session holding --context
tokens in a KV cache, then the median time of one decode step and of a verification block of --block rows with
logits at every row (what gpu-bench times). With --batch, the same decode step for B sessions at once (a batch
dimension over B caches of the same length: what gpu-bench's batched passes time). Eager mode: no torch.compile,
no CUDA graphs. Runs where gpu-bench runs (deploy/gpu/run-on-gpu.sh); needs torch with CUDA.

    python3 deploy/gpu/torch-step.py --shapes 1.5b --context 512 --json /tmp/torch.json
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# vocab, hidden, intermediate, layers, heads, kv heads, tied head
SHAPES = {
    "0.5b": (151936, 896, 4864, 24, 14, 2, True),
    "1.5b": (151936, 1536, 8960, 28, 12, 2, False),
    "7b": (152064, 3584, 18944, 28, 28, 4, False),
}


class Model:
    def __init__(self, shape, dev, dtype, layers=None):
        v, d, f, n, h, kv, tied = SHAPES[shape]
        n = layers or n
        self.h, self.kv, self.hd, self.d = h, kv, d // h, d
        g = torch.Generator(device=dev).manual_seed(0)

        def w(o, i):
            return torch.randn(o, i, device=dev, dtype=dtype, generator=g) * i ** -0.5

        def b(o):
            return torch.randn(o, device=dev, dtype=dtype, generator=g) * 0.1

        hd = self.hd
        self.layers = [
            dict(q=w(h * hd, d), bq=b(h * hd), k=w(kv * hd, d), bk=b(kv * hd), v=w(kv * hd, d), bv=b(kv * hd),
                 o=w(d, h * hd), gate=w(f, d), up=w(f, d), down=w(d, f),
                 n1=torch.ones(d, device=dev, dtype=dtype), n2=torch.ones(d, device=dev, dtype=dtype))
            for _ in range(n)
        ]
        self.embed = w(v, d)
        self.head = self.embed if tied else w(v, d)
        self.norm = torch.ones(d, device=dev, dtype=dtype)
        self.inv_freq = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))

    def cache(self, capacity, batch=1):
        z = lambda: torch.zeros(batch, capacity, self.kv, self.hd, device=self.embed.device, dtype=self.embed.dtype)
        return [(z(), z()) for _ in self.layers]

    def rope(self, x, pos):
        ang = pos[:, None].float() * self.inv_freq[None, :]  # (rows, hd / 2), shared by every session
        cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    @torch.inference_mode()
    def forward(self, tokens, cache, held, every_row=True):
        """tokens: (batch, rows), one row of tokens per session; every session holds `held` tokens. Logits at every
        row, or (a prefill) at the last."""
        bsz, r = tokens.shape
        pos = torch.arange(held, held + r, device=tokens.device)
        total = held + r
        mask = torch.ones(r, total, dtype=torch.bool, device=tokens.device)
        mask[:, held:] = torch.tril(torch.ones(r, r, dtype=torch.bool, device=tokens.device))
        x = self.embed[tokens]
        for l, (kc, vc) in zip(self.layers, cache):
            h = F.rms_norm(x, (self.d,), l["n1"], 1e-6)
            q = self.rope((h @ l["q"].T + l["bq"]).view(bsz, r, self.h, self.hd), pos)
            k = self.rope((h @ l["k"].T + l["bk"]).view(bsz, r, self.kv, self.hd), pos)
            kc[:, held:total] = k
            vc[:, held:total] = (h @ l["v"].T + l["bv"]).view(bsz, r, self.kv, self.hd)
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), kc[:, :total].transpose(1, 2), vc[:, :total].transpose(1, 2),
                attn_mask=mask, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(bsz, r, -1) @ l["o"].T
            h = F.rms_norm(x, (self.d,), l["n2"], 1e-6)
            x = x + (F.silu(h @ l["gate"].T) * (h @ l["up"].T)) @ l["down"].T
        if not every_row:
            x = x[:, -1:]
        logits = F.rms_norm(x, (self.d,), self.norm, 1e-6) @ self.head.T
        return logits.float().cpu()  # the logits come back to the host, as the engine's do


def timed(reps, f):
    for _ in range(2):
        f()
    ms = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1.5b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--batch", default="", help="sessions per batched decode step, e.g. 1,8,32 (empty: none)")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    out = []
    for s in a.shapes.split(","):
        m = Model(s, dev, torch.float16, a.layers)
        cache = m.cache(a.context + max(a.block, 1))
        ctx = torch.randint(0, m.embed.shape[0], (1, a.context), device=dev)
        m.forward(ctx, cache, 0, every_row=False)
        one = torch.tensor([[7]], device=dev)
        block = torch.randint(0, m.embed.shape[0], (1, a.block), device=dev)
        step = timed(a.reps, lambda: m.forward(one, cache, a.context))
        blk = timed(a.reps, lambda: m.forward(block, cache, a.context))
        row = dict(shape=s, dtype="float16", context=a.context, step_ms=step, block_rows=a.block, block_ms=blk,
                   block_x_step=blk / step, torch=torch.__version__, gpu=torch.cuda.get_device_name())
        print(f"torch eager {s}: decode step {step:.2f} ms, {a.block}-row block {blk:.2f} ms "
              f"({blk / step:.2f} steps)", flush=True)
        del cache
        batched = []
        for n in [int(b) for b in a.batch.split(",") if b]:
            cache = m.cache(a.context + 1, n)
            m.forward(ctx.expand(n, -1).contiguous(), cache, 0, every_row=False)
            ones = torch.full((n, 1), 7, device=dev)
            ms = timed(a.reps, lambda: m.forward(ones, cache, a.context))
            batched.append(dict(sessions=n, rows=1, ms=ms, rows_per_s=n / ms * 1e3))
            print(f"torch eager {s}: {n} sessions' decode step {ms:.2f} ms ({n / ms * 1e3:.0f} rows/s)", flush=True)
            del cache
        row["batched"] = batched
        out.append(row)
        del m
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
