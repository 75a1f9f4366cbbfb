"""Generate text from a model whose weights stay on NVMe.

    python examples/inference.py --model ./finetuned --prompt "17 plus 25 is" --max-new-tokens 16

The model is built on the meta device (no memory for weights), and ``offload.wrap(...,
checkpoint=DIR)`` with ``--param-tier nvme`` reads the weights where the safetensors files
hold them (nothing is copied or written; other tiers load them into memory); during
generation each layer's weights are read from disk just ahead of use within
``--device-budget``.
``--model`` is a local ``save_pretrained`` / ``offload.export`` directory (e.g. the output of
``examples/finetune.py``); without it a 355M-parameter GPT-2-style model with random
weights is saved to ``--work-dir`` first. Text is tokenized as bytes unless the directory
holds a tokenizer. Prints tokens/s and offload's stats (bytes read, stall seconds).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

import offload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune import local_path, positive, writable_parent  # noqa: E402

log = logging.getLogger("inference")


def main(argv=None) -> int:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default=None, type=local_path, help="local save_pretrained/export directory (default: a "
                        "random 355M GPT-2-style model saved to --work-dir)")
    parser.add_argument("--work-dir", default="./inference-model", help="where the default model is saved "
                        "(default ./inference-model)")
    parser.add_argument("--prompt", default="17 plus 25 is", help="text to continue")
    parser.add_argument("--max-new-tokens", type=positive, default=16, help="tokens to generate (default 16)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="compute device (default: cuda when available)")
    parser.add_argument("--param-tier", default="nvme", choices=["device", "host", "nvme"],
                        help="where weights rest between uses (default nvme)")
    parser.add_argument("--nvme-path", default="./offload-nvme", help="swap directory (default ./offload-nvme)")
    parser.add_argument("--device-budget", default="512MiB", help="most weight bytes on the device (512MiB)")
    parser.add_argument("--host-budget", default="1GiB", help="most bytes of host buffers (1GiB)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="compute dtype (fp32)")
    args = parser.parse_args(argv)
    if not args.prompt:
        parser.error("--prompt is empty: give text to continue")
    unwritable = args.param_tier == "nvme" and writable_parent(args.nvme_path)
    if unwritable:
        parser.error(f"--nvme-path {args.nvme_path!r}: {unwritable}")
    if args.param_tier == "nvme":
        try:
            os.makedirs(args.nvme_path, exist_ok=True)
        except OSError as err:
            parser.error(f"--nvme-path {args.nvme_path!r}: cannot create it ({err.strerror})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    path = args.model
    if path is None:
        path = args.work_dir
        if not os.path.exists(os.path.join(path, "config.json")):
            log.info("saving a random 355M-parameter GPT-2-style model to %s (once)", path)
            cfg = transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16)
            torch.manual_seed(0)
            transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    config = transformers.AutoConfig.from_pretrained(path)
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        parser.error(f"--model {path!r} is a {config.model_type} model, which has no causal language model class: "
                     "this example continues text with AutoModelForCausalLM (GPT-2, Llama, Qwen2, Mistral ...)")
    with offload.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.requires_grad_(False)  # inference: no gradients, and no fp32 values kept for master weights
    cfg = offload.OffloadConfig(device=args.device, param_tier=args.param_tier, optimizer_tier="host",
                                nvme_path=args.nvme_path if args.param_tier == "nvme" else None,
                                device_budget=args.device_budget, host_budget=args.host_budget,
                                compute_dtype=None if args.dtype == "fp32" else args.dtype)
    started = time.perf_counter()
    model = offload.wrap(model, cfg, checkpoint=path)
    model.eval()
    log.info("wrapped %s (param_tier %s) in %.1f s", path, args.param_tier, time.perf_counter() - started)
    tokenizer = None
    if os.path.exists(os.path.join(path, "tokenizer.json")) or os.path.exists(os.path.join(path, "vocab.json")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if tokenizer is not None:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        ids = torch.tensor([list(args.prompt.encode())])
    ids = ids.to(args.device)
    before = offload.stats(model)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=config.eos_token_id if config.eos_token_id is not None else 0)
    seconds = time.perf_counter() - started
    new = out[0, ids.shape[1]:].tolist()
    text = tokenizer.decode(new) if tokenizer is not None else bytes(t for t in new if t < 256).decode(errors="replace")
    now = offload.stats(model)
    print(f"{args.prompt}{text}")
    log.info("%d tokens in %.2f s: %.2f tokens/s | read %s | stall %.2f s | peak device %s host %s", len(new),
             seconds, len(new) / seconds, offload.format_size(now["read_bytes"] - before["read_bytes"]),
             now["stall_seconds"] - before["stall_seconds"], offload.format_size(now["device_peak_bytes"]),
             offload.format_size(now["host_peak_bytes"]))
    offload.unwrap(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
