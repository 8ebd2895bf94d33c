"""``python -m fastpipe hf-export CHECKPOINT OUTPUT --config CONFIG``: a ``fastpipe.checkpoint``
directory (saved at any layout) written in the Hugging Face format, offline, in one process.

Bad input (an incomplete or missing checkpoint, a config naming no model class, entries that
do not fit the model) is one line on stderr and exit status 2, no traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ..checkpoint import hf_format
from ..checkpoint.errors import CheckpointError

PROG = "python -m fastpipe hf-export"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``hf-export`` command on ``argv``; returns the exit code (2 for bad input)."""
    parser = _parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # --help, or a usage error argparse reported
        return exc.code if isinstance(exc.code, int) else 0
    try:
        model_class = _model_class(args.model_class)
        path = hf_format.convert(args.checkpoint, args.output, args.config,
                                 model_class=model_class)
    except (CheckpointError, OSError, ValueError, TypeError, ImportError) as error:
        print(f"{PROG}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    print(f"wrote {path} (load it with from_pretrained)")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Write the model of a fastpipe.checkpoint directory in the "
        "Hugging Face format (config and safetensors), so that from_pretrained loads it.")
    parser.add_argument("checkpoint", help="a complete fastpipe.checkpoint.save directory")
    parser.add_argument("output", help="the directory to write")
    parser.add_argument("--config", required=True,
                        help="the model's config: a directory holding config.json (e.g. the "
                             "one save_pretrained wrote), or that file")
    parser.add_argument("--model-class", default=None,
                        help="the transformers model class (default: the config's "
                             "architectures), e.g. LlamaForCausalLM")
    return parser


def _model_class(name: Optional[str]) -> Optional[type]:
    if name is None:
        return None
    import transformers
    found = getattr(transformers, name, None)
    if not isinstance(found, type):
        raise ValueError(f"--model-class {name!r} is no class of transformers")
    return found
