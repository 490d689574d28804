"""`refpar export CKPT OUT`: a refpar training checkpoint written as a Hugging Face model folder.

    refpar train --model tiny --dtype float64 --steps 20 --save runs/tiny
    refpar export runs/tiny hf-tiny          # runs/tiny's newest complete step, or runs/tiny/step-N
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('hf-tiny')"

OUT gets config.json (GPT2LMHeadModel, LlamaForCausalLM, or MixtralForCausalLM for Llama with experts
in every block; `dtype` the checkpoint's), model.safetensors
(Hugging Face's keys and layouts, the parameters in the checkpoint's dtype: a float64 run's stay
float64, so the round trip is exact) and the run's tokenizer.json if the run folder has one. It is
written in a temporary folder beside OUT and renamed at the end: OUT is whole or absent
(refpar/weights.py).
"""

from __future__ import annotations

import argparse

HELP = "write a training checkpoint as a Hugging Face folder (config.json + model.safetensors)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt", metavar="CKPT",
                        help="a checkpoint refpar train --save wrote: DIR/step-N, or DIR for its newest step")
    parser.add_argument("out", metavar="OUT", help="the folder to write (new, or empty)")


def run(args) -> int:
    from pathlib import Path

    from refpar.config import ConfigError
    from refpar.weights import export_checkpoint, hf_config

    if not Path(args.ckpt).is_dir():
        raise ConfigError(f"{args.ckpt} is not a folder; give the checkpoint folder refpar train --save "
                          "wrote (DIR or DIR/step-N)")
    out, config, tokenizer = export_checkpoint(args.ckpt, args.out)
    family = hf_config(config)["architectures"][0]
    print(f"wrote {out}: {family}, {config.n_layer} layers, {config.n_embd} channels, {config.dtype}"
          + (f", with {tokenizer}" if tokenizer else "")
          + f"; load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})", flush=True)
    return 0
