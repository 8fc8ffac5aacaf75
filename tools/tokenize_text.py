#!/usr/bin/env python3
"""Tokenize text files into a token file tandem-train reads (Note [Token files]
in tools/train/data.h): the llm.c layout, a 256-int32 header (20240520,
version 1 for uint16 ids or 2 for uint32, token count) and the ids.

    pip install transformers
    python3 tools/tokenize_text.py --tokenizer meta-llama/Llama-3.2-1B corpus.txt -o corpus.bin

--tokenizer takes anything AutoTokenizer.from_pretrained takes: a hub name or
a local directory (a checkpoint's, with tokenizer.json). Each input file is
one document: its ids, preceded by the tokenizer's BOS token when it has one
and followed by EOS when it has one, are appended in the order given.

--prompt TEXT writes one prompt for tandem-generate instead: its ids after
BOS, without EOS.

    python3 tools/tokenize_text.py --tokenizer DIR --prompt "Once upon a time" -o prompt.bin
    build/tools/tandem-generate DIR --prompt-file prompt.bin
"""
import argparse
import struct
import sys

MAGIC = 20240520


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="*", help="text files, one document each")
    parser.add_argument("--prompt", help="tokenize this text as a prompt instead of files")
    parser.add_argument("--tokenizer", required=True, help="hub name or local directory")
    parser.add_argument("-o", "--output", required=True, help="the token file to write")
    args = parser.parse_args()
    if bool(args.inputs) == (args.prompt is not None):
        parser.error("expected text files or --prompt TEXT (one of them)")

    import transformers  # only needed here, so --help works without it

    tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    ids = []
    if args.prompt is not None:
        ids = tok.encode(args.prompt, add_special_tokens=False)
        if tok.bos_token_id is not None:
            ids = [tok.bos_token_id] + ids
    for path in args.inputs:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        doc = tok.encode(text, add_special_tokens=False)
        if tok.bos_token_id is not None:
            doc = [tok.bos_token_id] + doc
        if tok.eos_token_id is not None:
            doc = doc + [tok.eos_token_id]
        ids.extend(doc)
    if not ids:
        sys.exit("tokenize_text.py: the inputs hold no tokens")
    wide = max(ids) > 0xFFFF
    if len(ids) >= 2**31:
        sys.exit(f"tokenize_text.py: {len(ids)} tokens exceed the format's int32 count; split the input")
    header = [MAGIC, 2 if wide else 1, len(ids)] + [0] * 253
    with open(args.output, "wb") as out:
        out.write(struct.pack("<256i", *header))
        out.write(struct.pack(f"<{len(ids)}{'I' if wide else 'H'}", *ids))
    print(f"{args.output}: {len(ids)} tokens (uint{32 if wide else 16}, vocab {len(tok)}) "
          f"from {'the prompt' if args.prompt is not None else f'{len(args.inputs)} file(s)'}")


if __name__ == "__main__":
    main()
