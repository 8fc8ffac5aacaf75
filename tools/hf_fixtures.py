#!/usr/bin/env python3
"""Tiny Hugging Face checkpoints and their reference outputs, as test fixtures.

Run by hand (needs `pip install torch transformers safetensors`), never by CI:

    python3 tools/hf_fixtures.py tests/fixtures/hf
    python3 tools/hf_fixtures.py --check-export build/tests/tandem-tests-train

The second form asks the Catch2 test to write every fixture model as tandem
saves it (sharded, through TANDEM_LLAMA_EXPORT_DIR), loads each with
`transformers` and checks its logits against the stored reference.

For each model family below it builds a tiny random model with `transformers`,
saves it with `save_pretrained` (config.json + model.safetensors, f32), and
writes `reference.safetensors` next to it: the input batch, the logits, the
causal-LM loss of that batch (labels = inputs, shifted inside the model as
`transformers` does), the gradients of a few parameters and the tokens that
greedy `generate` (with its KV cache) continues a prompt with. `versions.json`
records what made them. The Catch2 tests load each checkpoint into tandem and
compare (tests/train/test_llama.cpp, tests/train/test_generate.cpp).

`tokenizers/` holds two tiny tokenizers trained with `tokenizers`, one
byte-level BPE (GPT-2, Llama 3, Qwen2 style) and one SentencePiece-style BPE
with byte fallback (Llama 2, Mistral style), with `decode.json`: token ids and
the text `tokenizer.decode(ids, skip_special_tokens=True)` gives for them.
"""
import json
import os
import pathlib
import sys

import safetensors.torch
import torch
import transformers

BATCH, SEQ = 2, 12
PROMPT, NEW_TOKENS = 5, 16

# (name, config class, config fields). Every model is small enough for its
# files to stay a few kilobytes; grouped-query heads everywhere.
COMMON = dict(
    vocab_size=48,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    torch_dtype="float32",
)
MODELS = [
    ("llama", transformers.LlamaConfig,
     dict(COMMON, rope_theta=10000.0, tie_word_embeddings=False)),
    # Llama 3 frequency scaling with a short original context, so that the
    # tiny head_dim has a stretched, a blended and a kept frequency band.
    ("llama3-scaled", transformers.LlamaConfig,
     dict(COMMON, head_dim=8, num_attention_heads=2, num_key_value_heads=1, rope_theta=500.0,
          tie_word_embeddings=False,
          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=16))),
    # Qwen2: biases on q/k/v, tied embeddings.
    ("qwen2", transformers.Qwen2Config,
     dict(COMMON, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)),
    # Mixtral: every MLP an MoE of 4 SwiGLU experts, 2 per token.
    ("mixtral", transformers.MixtralConfig,
     dict(COMMON, rope_theta=10000.0, tie_word_embeddings=False, num_local_experts=4,
          num_experts_per_tok=2, router_jitter_noise=0.0, sliding_window=None)),
]
# Gradients stored for the test: every layer kind once.
GRAD_PARAMS = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.norm.weight",
]


def randomise(model):
    """Weights far from the tiny default init, norms away from 1, so that
    every part of the model moves the logits."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.3 * noise)


def make(out_dir, name, config_class, fields):
    torch.manual_seed(0)
    config = config_class(**fields)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    randomise(model)
    model.eval()
    target = out_dir / name
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)

    gen = torch.Generator().manual_seed(99)
    input_ids = torch.randint(0, fields["vocab_size"], (BATCH, SEQ), generator=gen)
    model.zero_grad()
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    params = dict(model.named_parameters())
    reference = {
        "input_ids": input_ids.to(torch.int64).contiguous(),
        "logits": out.logits.detach().to(torch.float32).contiguous(),
        "loss": out.loss.detach().reshape(1).to(torch.float32).contiguous(),
    }
    for p in GRAD_PARAMS:
        if p in params and params[p].grad is not None:
            reference["grad." + p] = params[p].grad.detach().contiguous()
    # Mixtral's experts are fused in memory (gate and up stacked, per expert);
    # the checkpoint, and tandem, name each expert's w1 (gate), w3 (up) and
    # w2 (down): store their gradients under those names.
    for layer in (0, 1):
        moe = f"model.layers.{layer}.mlp."
        if moe + "gate.weight" not in params:
            continue
        saved = f"grad.model.layers.{layer}.block_sparse_moe."
        reference[saved + "gate.weight"] = params[moe + "gate.weight"].grad.detach().clone()
        gate_up = params[moe + "experts.gate_up_proj"].grad.detach()
        down = params[moe + "experts.down_proj"].grad.detach()
        inner = fields["intermediate_size"]
        for e in (0, 3):
            reference[saved + f"experts.{e}.w1.weight"] = gate_up[e, :inner].clone()
            reference[saved + f"experts.{e}.w3.weight"] = gate_up[e, inner:].clone()
            reference[saved + f"experts.{e}.w2.weight"] = down[e].clone()
    # Greedy continuation of the first sequence's first tokens, never
    # stopping early (no eos).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        generated = model.generate(input_ids=input_ids[:1, :PROMPT], max_new_tokens=NEW_TOKENS,
                                   do_sample=False, use_cache=True)
    reference["generate.prompt"] = input_ids[0, :PROMPT].to(torch.int64).clone()
    reference["generate.greedy"] = generated[0, PROMPT:].to(torch.int64).clone()
    safetensors.torch.save_file(reference, str(target / "reference.safetensors"))
    print(f"{name}: loss {out.loss.item():.6f}, {sum(p.numel() for p in params.values())} "
          f"parameters -> {target}")


TOKENIZER_TEXT = [
    "the quick brown fox jumps over the lazy dog. ",
    "a stitch in time saves nine, and all that glitters is not gold. ",
    "naive cafe, or rather naïve café: ünïcödé — 12345 ",
] * 8
DECODE_TEXTS = [
    "the lazy fox",
    "  two spaces and a tab\there",
    "naïve café — ünïcödé 😀 in full",
    "tokens it never saw: qzxj ~ {}[]",
]


def make_tokenizers(out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(TOKENIZER_TEXT, trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"]))
    metaspace = Tokenizer(models.BPE(byte_fallback=True))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                       prepend_scheme="first")
    metaspace.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    metaspace.train_from_iterator(TOKENIZER_TEXT, trainers.BpeTrainer(
        vocab_size=340,
        special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]))
    for name, tok in (("byte-level", byte_level), ("metaspace", metaspace)):
        target = out_dir / "tokenizers" / name
        target.mkdir(parents=True, exist_ok=True)
        tok.save(str(target / "tokenizer.json"))
        special = tok.token_to_id("<|endoftext|>" if name == "byte-level" else "<s>")
        cases = []
        for text in DECODE_TEXTS:
            ids = [special] + tok.encode(text).ids + [special]
            cases.append({"ids": ids, "text": tok.decode(ids, skip_special_tokens=True)})
        (target / "decode.json").write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
        print(f"tokenizer {name}: {tok.get_vocab_size()} tokens -> {target}")


def check_export(test_binary):
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TANDEM_LLAMA_EXPORT_DIR=tmp)
        subprocess.run([test_binary, "a Llama checkpoint saved by tandem*"], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        fixtures = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
        failed = False
        for name, _, _ in MODELS:
            model = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/{name}")
            model.eval()
            ref = safetensors.torch.load_file(str(fixtures / name / "reference.safetensors"))
            with torch.no_grad():
                logits = model(input_ids=ref["input_ids"]).logits
            ok = torch.allclose(logits, ref["logits"], rtol=1e-4, atol=1e-5)
            print(f"{name}: tandem's export loads in transformers, logits "
                  f"{'match' if ok else 'DIFFER'} (max |diff| "
                  f"{(logits - ref['logits']).abs().max().item():.2e})")
            failed |= not ok
        sys.exit(1 if failed else 0)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--check-export":
        check_export(sys.argv[2])
    out_dir = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/hf")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, config_class, fields in MODELS:
        make(out_dir, name, config_class, fields)
    make_tokenizers(out_dir)
    import tokenizers
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "safetensors": safetensors.__version__, "tokenizers": tokenizers.__version__,
                "script": "tools/hf_fixtures.py"}
    (out_dir / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")


if __name__ == "__main__":
    main()
