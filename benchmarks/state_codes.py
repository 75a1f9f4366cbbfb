"""What coding the optimizer's rows costs: ns per element to code and to decode one row of
each ``offload.optim._formats.RowCode``, next to torch's fused AdamW over the same elements
(the update the coding surrounds) and a plain copy (the memory bandwidth floor). The 8-bit
codes are timed twice: as the optimizer codes them (one compiled loop per row where
``torch.compile`` works, ``offload.optim._coding``) and eagerly.

    python benchmarks/state_codes.py --json docs/results/state_codes.json

One shard row of ``--elements`` fp32 values (16M by default, the default shard size): a
first moment (normal, 1e-3), a second moment (uniform, 1e-6); best of ``--reps`` runs, on
all of torch's threads. With torchao installed (``pip install --no-deps torchao``), its
8-bit code (``quantize_8bit_with_qmap`` over 256-element blocks, eager) is timed beside
ours; it is not a dependency.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

log = logging.getLogger("bench.state_codes")


def best_ns(fn, n: int, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e9 / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--elements", type=int, default=16 << 20, help="elements per row (default 16M)")
    parser.add_argument("--reps", type=int, default=5, help="timed runs, best kept (default 5)")
    parser.add_argument("--json", default=None, help="write the figures as JSON to this path")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from offload.optim._coding import eager_coding
    from offload.optim._formats import BLOCK, Packing, RowCode, dither_at

    n = args.elements // BLOCK * BLOCK
    torch.manual_seed(0)
    first, second = torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    rows = torch.empty(1, n)
    out: dict = {"elements": n, "threads": torch.get_num_threads(), "codes": {}}
    copy = best_ns(lambda: rows.copy_(first.view(1, n)), n, args.reps)
    out["copy_ns"] = copy
    for code in RowCode:
        src = second if code is RowCode.SQRT8 else first
        packing = Packing((code,), n)
        packed = torch.empty(packing.nbytes, dtype=torch.uint8)

        def encode():
            rows.copy_(src.view(1, n))
            if code is RowCode.BF16_SR:
                packing.round_in_place(rows, [(0, n, dither_at(0, 1, 0))])  # (the whole row: one parameter)
            packing.encode(rows, packed)

        encode_ns = best_ns(encode, n, args.reps) - copy  # (less the copy that refills the row)
        eager_ns = None  # (only the 8-bit codes have a compiled path)
        if code.scaled:
            with eager_coding():
                eager_ns = best_ns(encode, n, args.reps) - copy
        decode_ns = best_ns(lambda: packing.decode(packed, rows), n, args.reps)
        out["codes"][code.name] = {"encode_ns": encode_ns, "eager_encode_ns": eager_ns, "decode_ns": decode_ns,
                                   "bytes_per_element": packing.nbytes / n}
    p, g, m, v = torch.randn(n), torch.randn(n), first.clone(), second.clone()
    step = torch.tensor(1.0)
    out["fused_adamw_ns"] = best_ns(lambda: torch._fused_adamw_(
        [p], [g], [m], [v], [], [step], amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01,
        eps=1e-8, maximize=False, grad_scale=None, found_inf=None), n, args.reps)
    try:
        from torchao.optim.quant_utils import quantize_8bit_with_qmap
        from torchao.optim.subclass_8bit import get_qmap_signed

        qmap = torch.tensor(get_qmap_signed())
        blocks = first.view(-1, BLOCK)

        def torchao_code():
            scale = blocks.abs().amax(-1).clip(1e-12)
            quantize_8bit_with_qmap((blocks / scale[:, None]).view(-1), qmap)

        out["torchao_8bit_encode_ns"] = best_ns(torchao_code, n, max(1, args.reps // 2))
    except ImportError:
        out["torchao_8bit_encode_ns"] = None
    print(f"{n} elements, {out['threads']} threads; a copy {copy:.2f} ns, torch's fused AdamW "
          f"{out['fused_adamw_ns']:.2f} ns per element")
    print("code      bytes/el  encode ns  eager encode ns  decode ns")
    for name, row in out["codes"].items():
        eager = "-" if row["eager_encode_ns"] is None else f"{row['eager_encode_ns']:.2f}"
        print(f"{name:9s} {row['bytes_per_element']:8.3f} {row['encode_ns']:10.2f} {eager:>16s} "
              f"{row['decode_ns']:10.2f}")
    if out["torchao_8bit_encode_ns"] is not None:
        print(f"torchao 8-bit code, eager: {out['torchao_8bit_encode_ns']:.2f} ns per element")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
        log.info("wrote %s", args.json)


if __name__ == "__main__":
    main()
