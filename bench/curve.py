"""The throughput curve of bench/bench_scale.py (`--only curve`): its table and its PNG.

One row per number of requests N (all arriving at once, ragged prompts, greedy): decode tokens/s and median
time to first token of each engine on a warm engine, against the decode roof of N rows (the weights read once
a step at the measured read bandwidth, or N rows of matmul at the measured FLOP rate, whichever is slower).
"""
from __future__ import annotations

from pathlib import Path

HEADER = ("requests", "prompt tok", "torch tok/s", "jax tok/s", "jax/torch", "roof tok/s", "jax/roof",
          "torch/roof", "ttft torch ms", "ttft jax ms", "ttft j/t", "identical", "point s (t+j)")


def decode_roof(rows: int, weight_bytes: float, matmul_params: float, read_bytes_per_s: float,
                matmul_flops: float) -> float:
    """Tokens/s of a decode step of `rows` sequences at the roof: max(weights / bandwidth, rows x 2P / FLOP/s)."""
    return rows / max(weight_bytes / read_bytes_per_s, 2 * matmul_params * rows / matmul_flops)


def row(n: int, torch_threads: int, t: dict, j: dict, roof: float) -> dict:
    return {"requests": n, "prompt_tokens": j["prompt_tokens"], "torch_threads": torch_threads,
            "torch_tps": t["decode_tps"], "jax_tps": j["decode_tps"], "roof_tps": roof,
            "torch_ttft_s": t["ttft_s"], "jax_ttft_s": j["ttft_s"], "identical": t["outputs"] == j["outputs"],
            "torch_point_s": t["point_s"], "jax_point_s": j["point_s"]}


def format_row(r: dict) -> str:
    cells = (r["requests"], r["prompt_tokens"], f"{r['torch_tps']:.1f} ({r['torch_threads']}t)", f"{r['jax_tps']:.1f}",
             f"{r['jax_tps'] / r['torch_tps']:.2f}x", f"{r['roof_tps']:.0f}", f"{r['jax_tps'] / r['roof_tps']:.0%}",
             f"{r['torch_tps'] / r['roof_tps']:.0%}", f"{r['torch_ttft_s'] * 1e3:.0f}", f"{r['jax_ttft_s'] * 1e3:.0f}",
             f"{r['jax_ttft_s'] / r['torch_ttft_s']:.2f}", r["identical"],
             f"{r['torch_point_s']:.0f}+{r['jax_point_s']:.0f}")
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table_head() -> str:
    return "| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER)


def plot(rows: list[dict], path: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = [r["requests"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(n, [r["roof_tps"] for r in rows], "k--", label="decode roof")
    ax1.plot(n, [r["torch_tps"] for r in rows], "o-", label="torch")
    ax1.plot(n, [r["jax_tps"] for r in rows], "s-", label="jax")
    ax1.set(xscale="log", yscale="log", xlabel="requests (all at once)", ylabel="decode tokens/s",
            title="decode throughput")
    ax2.plot(n, [r["torch_ttft_s"] * 1e3 for r in rows], "o-", label="torch")
    ax2.plot(n, [r["jax_ttft_s"] * 1e3 for r in rows], "s-", label="jax")
    ax2.set(xscale="log", xlabel="requests (all at once)", ylabel="median TTFT ms (warm engine)",
            title="time to first token")
    for ax in (ax1, ax2):
        ax.set_xticks(n, [str(x) for x in n])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
