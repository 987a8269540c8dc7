"""``mcompile preprocess``: JSONL / text files -> a tokenized indexed dataset (PREFIX.bin, PREFIX.idx).

    mcompile preprocess corpus.jsonl more/ --tokenizer tokenizer.json --output data/corpus
    mcompile preprocess books.txt --tokenizer tokenizer.model --output data/books --txt-split blank
    mcompile preprocess tiny --tokenizer tiny --output data/tiny     # the corpus and tokenizer mcompile ships

``add_parser(subparsers)`` registers the subcommand (the ``mcompile`` command calls it); ``run(args)``
runs it and returns the exit status (2 with a one-line error for bad input). Nothing heavy is imported
until ``run``.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "preprocess", help="tokenize JSONL or text files into an indexed dataset (PREFIX.bin / PREFIX.idx)",
        description="Tokenize JSONL or text files into a memory-mapped indexed dataset (PREFIX.bin / PREFIX.idx), "
                    "one document per JSON line (or text block), each ending in the tokenizer's EOS.")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files or folders: *.jsonl / *.json (one JSON object per line), *.txt; gzip allowed (.gz); "
                        "'tiny': the corpus mcompile ships")
    p.add_argument("--tokenizer", required=True, metavar="T",
                   help="tokenizer.json (Hugging Face tokenizers), a tiktoken ranks file or a sentencepiece .model; "
                        "'tiny': the 256-token tokenizer mcompile ships")
    p.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--text-key", default="text", help="the JSON key holding each document's text (default: text)")
    p.add_argument("--no-eos", action="store_true", help="do not end each document with the EOS token")
    p.add_argument("--txt-split", choices=["blank", "line", "file"], default="blank",
                   help="text files: a document per blank-line separated block (default), per line, or per file")
    p.add_argument("--eos", default=None, metavar="TOKEN",
                   help="the EOS token's name, where the tokenizer file does not say it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from mcompile.apps.data.assets import tiny_corpus, tiny_tokenizer
    from mcompile.apps.data.errors import DataError
    from mcompile.apps.data.preprocessing import preprocess
    from mcompile.apps.data.tokenizer import load_tokenizer

    # "tiny": the corpus / tokenizer mcompile ships (from any folder, a pip install included)
    inputs = [str(tiny_corpus()) if x == "tiny" else x for x in args.inputs]
    try:
        tok = load_tokenizer(str(tiny_tokenizer()) if args.tokenizer == "tiny" else args.tokenizer, eos=args.eos)
        stats = preprocess(inputs, args.output, tok, text_key=args.text_key, append_eos=not args.no_eos,
                           progress=not args.no_progress, txt_split=args.txt_split)
    except DataError as e:
        print(f"mcompile: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(stats, indent=1))
    else:
        print(f"{stats['documents']} documents, {stats['tokens']} tokens ({stats['skipped_empty']} empty skipped) "
              f"from {stats['files']} file(s) in {stats['seconds']:.2f} s ({stats['tokens_per_s']:,} tokens/s) "
              f"-> {stats['bin']}, {stats['idx']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mcompile.apps.data.cli INPUT... --tokenizer T --output PREFIX`` (the same as ``mcompile
    preprocess``)."""
    parser = argparse.ArgumentParser(prog="mcompile")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["preprocess", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
