"""Per-layer kernel times from a ``bench/profile_gpu_decode.py --timeline N`` log (N >= one forward's kernels).

    python bench/layer_times.py profile.log [--per-layer 6] [--first 2] [--ends]

Kernels of a PDL chain overlap, so each kernel's time is counted from the previous kernel's end to its own end.
Prints the median over the layers (the first and last layer dropped) of each of a layer's ``--per-layer`` kernels,
their sum, and the kernels after the last layer (final norm, lm_head, ...). ``--ends`` also splits the first forward
into its head (step start to the first layer's first kernel), its layers and its tail (to the forward's last end),
and gives the end of the first layer's first kernel and the time from it to the layers' end.
"""

from __future__ import annotations

import argparse
import re
import statistics

ROW = re.compile(r"\s*([\d.]+) \|\s*([-\d.]+) \|\s*([\d.]+) \| (.*)")


def timeline(path: str) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of each kernel line of the log, in order."""
    rows = []
    for line in open(path):
        m = ROW.match(line)
        if m:
            start, duration = float(m[1]), float(m[3])
            rows.append((start, start + duration, m[4].strip()))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--per-layer", type=int, default=6, help="kernels per decoder layer")
    ap.add_argument("--first", type=int, default=None,
                    help="kernels before the first layer (input copy, embedding); default: those before the first "
                         "qkv_rope_store kernel, else 2")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ends", action="store_true", help="print the first forward's head, layers and tail, us")
    args = ap.parse_args()
    rows = timeline(args.log)
    if args.first is None:
        args.first = next((i for i, row in enumerate(rows) if row[2].startswith("_qkv_rope_store_kernel")), 2)
    if args.ends:
        n = int(re.search(r"in (\d+) kernels", open(args.log).read())[1])  # kernels in one forward
        head, first_end = rows[args.first][:2]
        layers_end = rows[args.first + args.per_layer * args.layers - 1][1]
        tail = max(end for _, end, _ in rows[:n]) - layers_end
        print(f"head {head:.1f} | layers {layers_end - head:.1f} | tail {tail:.1f} | the first layer's first kernel "
              f"ends at {first_end:.1f}, the layers after it {layers_end - first_end:.1f}")
    ends = [end for _, end, _ in rows]
    since = [ends[0]] + [ends[i] - ends[i - 1] for i in range(1, len(ends))]  # us from the previous kernel's end
    k, first = args.per_layer, args.first
    names, medians = [], []
    for j in range(k):
        names.append(rows[first + j][2][:28])
        medians.append(statistics.median(since[first + k * layer + j] for layer in range(1, args.layers - 1)))
    print(" | ".join(names) + " | layer")
    print(" | ".join(f"{m:.2f}" for m in medians) + f" | {sum(medians):.1f}")
    tail = first + k * args.layers
    print("after the layers: " + ", ".join(f"{rows[i][2][:28]} {since[i]:.1f}" for i in range(tail, tail + 3)
                                           if i < len(rows)))


if __name__ == "__main__":
    main()
