#!/usr/bin/env python3
"""Reference answers from llama.cpp (through llama-cpp-python) and from jinja2, for kvx tests.

Every subcommand reads JSON lines on stdin and writes one JSON line per input line on stdout,
in order, so a test can send a whole corpus through one process. Bytes that need not be UTF-8
(token pieces, detokenized text) are written as lowercase hex.

Subcommands
-----------
tokenize --model GGUF
    in:  {"text": str, "add_special": bool, "parse_special": bool}
    out: {"ids": [int], "pieces": hex, "pieces_plain": hex, "detok": hex}
         pieces        concatenated llama_token_to_piece(special=true) of the ids
         pieces_plain  the same with special=false (control tokens render as nothing)
         detok         llama_detokenize(remove_special=false, unparse_special=true), which
                       also applies the model's clean-up of spaces

vocab --model GGUF
    in:  nothing (stdin is not read)
    out: one object: n_vocab, bos, eos, eot, pad, sep, nl, fim_*, add_bos, add_eos,
         eog (ids), attrs (per token), pieces / pieces_plain (hex per token)

render
    in:  {"template": str, "messages": [...], "add_generation_prompt": bool,
          "bos_token": str, "eos_token": str, "tools": any (optional),
          "documents": any (optional), "extra": {...} (optional template variables),
          "now": unix seconds (optional; fixes strftime_now, UTC)}
    out: {"text": str} or {"error": str}
    Renders the way Hugging Face transformers' apply_chat_template does: a sandboxed jinja2
    environment with trim_blocks and lstrip_blocks, loop controls, the {% generation %} tag,
    raise_exception, strftime_now, and a json.dumps-based tojson.

generate --model GGUF [--threads N] [--ctx N]
    in:  {"prompt_ids": [int], "max_tokens": int}
    out: {"token_ids": [int], "top2": [[id1, logit1, id2, logit2], ...]}
    Greedy decoding the way llama-cpp-python's Llama.eval drives llama.cpp: the prompt in
    batches of 512 tokens, then one token per llama_decode; the first maximum is taken;
    generation stops after an end-of-generation token (included) or max_tokens. top2 gives,
    for each generated token, the two highest logits at that step.

perplexity --model GGUF [--threads N]
    in:  {"text": str, "ctx": int}
    out: {"ppl": float, "nll": float, "tokens": int (scored), "chunks": int, "n_text": int}
    llama-perplexity's computation on llama.cpp's logits: the text tokenized with the model's
    special tokens added, cut into len / ctx windows, each decoded alone in one batch of ctx
    tokens (first token replaced by BOS when the model adds one), the tokens after position
    ctx / 2 scored with llama-perplexity's log-softmax (float maximum, double sum of expf).

New subcommands go beside these: add a `cmd_<name>(args)` function and register it in
`build_parser()`. Only llama_cpp, jinja2, numpy and the standard library may be imported.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

# ---------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------


def read_jsonl() -> Iterator[dict]:
    """Yields one JSON object per non-empty stdin line."""
    for line in sys.stdin:
        line = line.strip()
        if line:
            yield json.loads(line)


def emit(obj: Any) -> None:
    """Writes one JSON line to stdout and flushes, so callers can stream."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


_LOG_CALLBACK = None  # keeps the ctypes callback alive while llama.cpp holds it


def load_model(path: str, vocab_only: bool = True):
    """Loads a GGUF with llama.cpp's own loader and returns (model, vocab) raw handles.

    Logging is silenced so stdout/stderr carry only our output.
    """
    import llama_cpp

    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = vocab_only
    model = llama_cpp.llama_model_load_from_file(path.encode("utf-8"), params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    return model, llama_cpp.llama_model_get_vocab(model)


# ---------------------------------------------------------------------------------------
# tokenizer oracles
# ---------------------------------------------------------------------------------------


def tokenize(vocab, text: bytes, add_special: bool, parse_special: bool) -> list[int]:
    import llama_cpp

    n_max = len(text) + 16
    while True:
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(vocab, text, len(text), buf, n_max, add_special, parse_special)
        if n >= 0:
            return list(buf[:n])
        n_max = -n


def token_to_piece(vocab, token: int, special: bool) -> bytes:
    import llama_cpp

    size = 64
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, size, 0, special)
        if n >= 0:
            return buf.raw[:n]
        size = -n


def detokenize(vocab, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
    import llama_cpp

    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 16 * len(ids)
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse_special)
        if n >= 0:
            return buf.raw[:n]
        size = -n


def cmd_tokenize(args: argparse.Namespace) -> None:
    _, vocab = load_model(args.model)
    for req in read_jsonl():
        ids = tokenize(vocab, req["text"].encode("utf-8"), bool(req.get("add_special", False)),
                       bool(req.get("parse_special", False)))
        emit({
            "ids": ids,
            "pieces": b"".join(token_to_piece(vocab, t, True) for t in ids).hex(),
            "pieces_plain": b"".join(token_to_piece(vocab, t, False) for t in ids).hex(),
            "detok": detokenize(vocab, ids, False, True).hex(),
        })


def cmd_vocab(args: argparse.Namespace) -> None:
    import llama_cpp as lc

    _, vocab = load_model(args.model)
    n = lc.llama_vocab_n_tokens(vocab)
    emit({
        "n_vocab": n,
        "bos": lc.llama_vocab_bos(vocab),
        "eos": lc.llama_vocab_eos(vocab),
        "eot": lc.llama_vocab_eot(vocab),
        "pad": lc.llama_vocab_pad(vocab),
        "sep": lc.llama_vocab_sep(vocab),
        "nl": lc.llama_vocab_nl(vocab),
        "fim_pre": lc.llama_vocab_fim_pre(vocab),
        "fim_suf": lc.llama_vocab_fim_suf(vocab),
        "fim_mid": lc.llama_vocab_fim_mid(vocab),
        "fim_pad": lc.llama_vocab_fim_pad(vocab),
        "fim_rep": lc.llama_vocab_fim_rep(vocab),
        "fim_sep": lc.llama_vocab_fim_sep(vocab),
        "add_bos": bool(lc.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(lc.llama_vocab_get_add_eos(vocab)),
        "eog": [t for t in range(n) if lc.llama_vocab_is_eog(vocab, t)],
        "attrs": [int(lc.llama_vocab_get_attr(vocab, t)) for t in range(n)],
        "pieces": [token_to_piece(vocab, t, True).hex() for t in range(n)],
        "pieces_plain": [token_to_piece(vocab, t, False).hex() for t in range(n)],
    })


# ---------------------------------------------------------------------------------------
# chat template oracle (Hugging Face transformers' rendering)
# ---------------------------------------------------------------------------------------


def compile_template(source: str, now: float | None):
    """Compiles a chat template exactly as transformers' _compile_jinja_template does."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """{% generation %}...{% endgeneration %}: renders its body (transformers uses it to
        mark assistant tokens; the text is unchanged)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        # transformers formats datetime.now(), a naive local time; a fixed moment is given as
        # naive UTC so %Z and %z stay empty the same way.
        if now is None:
            moment = datetime.now()
        else:
            moment = datetime.fromtimestamp(now, tz=timezone.utc).replace(tzinfo=None)
        return moment.strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def cmd_render(args: argparse.Namespace) -> None:
    for req in read_jsonl():
        try:
            template = compile_template(req["template"], req.get("now"))
            variables = dict(req.get("extra") or {})
            variables.update(
                messages=req["messages"],
                tools=req.get("tools"),
                documents=req.get("documents"),
                add_generation_prompt=bool(req.get("add_generation_prompt", False)),
                bos_token=req.get("bos_token", ""),
                eos_token=req.get("eos_token", ""),
            )
            emit({"text": template.render(**variables)})
        except Exception as e:  # noqa: BLE001 - any template failure is an answer here
            emit({"error": f"{type(e).__name__}: {e}"})


# ---------------------------------------------------------------------------------------
# generation oracle
# ---------------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> None:
    import numpy as np
    import llama_cpp as lc

    model, vocab = load_model(args.model, vocab_only=False)
    cp = lc.llama_context_default_params()
    cp.n_ctx = args.ctx
    cp.n_batch = 512
    cp.n_ubatch = 512
    cp.n_threads = args.threads
    cp.n_threads_batch = args.threads
    cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED  # llama-cpp-python's default
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit("llama.cpp could not create a context")
    n_vocab = lc.llama_vocab_n_tokens(vocab)

    def decode(tokens: list[int]) -> None:
        arr = (lc.llama_token * len(tokens))(*tokens)
        if lc.llama_decode(ctx, lc.llama_batch_get_one(arr, len(tokens))) != 0:
            raise SystemExit("llama_decode failed")

    for req in read_jsonl():
        prompt = [int(t) for t in req["prompt_ids"]]
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        for i in range(0, len(prompt), 512):
            decode(prompt[i:i + 512])
        out: list[int] = []
        top2: list[list[float]] = []
        for _ in range(int(req["max_tokens"])):
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            order = np.argsort(-logits, kind="stable")[:2]
            tok = int(np.argmax(logits))
            out.append(tok)
            top2.append([int(order[0]), float(logits[order[0]]), int(order[1]), float(logits[order[1]])])
            if lc.llama_vocab_is_eog(vocab, tok) or len(out) == int(req["max_tokens"]):
                break
            decode([tok])
        emit({"token_ids": out, "top2": top2})


def cmd_perplexity(args: argparse.Namespace) -> None:
    import math

    import numpy as np
    import llama_cpp as lc

    model, vocab = load_model(args.model, vocab_only=False)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    add_bos = bool(lc.llama_vocab_get_add_bos(vocab))
    bos = lc.llama_vocab_bos(vocab)
    for req in read_jsonl():
        n_ctx = int(req["ctx"])
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = n_ctx
        cp.n_threads = args.threads
        cp.n_threads_batch = args.threads
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = lc.llama_init_from_model(model, cp)
        if not ctx:
            raise SystemExit("llama.cpp could not create a context")
        tokens = tokenize(vocab, req["text"].encode("utf-8"), True, False)
        chunks = len(tokens) // n_ctx
        first = n_ctx // 2
        batch = lc.llama_batch_init(n_ctx, 0, 1)
        nll = 0.0
        for c in range(chunks):
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            window = tokens[c * n_ctx:(c + 1) * n_ctx]
            if add_bos:
                window[0] = bos
            batch.n_tokens = n_ctx
            for k, t in enumerate(window):
                batch.token[k] = t
                batch.pos[k] = k
                batch.n_seq_id[k] = 1
                batch.seq_id[k][0] = 0
                batch.logits[k] = 1
            if lc.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed")
            for j in range(first, n_ctx - 1):
                row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, j), shape=(n_vocab,))
                m = np.float32(row.max())
                sum_exp = float(np.sum(np.exp(row - m, dtype=np.float32), dtype=np.float64))
                nll += -(float(np.float32(row[window[j + 1]] - m)) - math.log(sum_exp))
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        scored = chunks * (n_ctx - 1 - first)
        emit({"ppl": math.exp(nll / scored) if scored else None, "nll": nll, "tokens": scored,
              "chunks": chunks, "n_text": len(tokens)})


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], None], help_: str, model: bool) -> None:
        p = sub.add_parser(name, help=help_)
        if model:
            p.add_argument("--model", required=True, help="path to a GGUF file")
        p.set_defaults(func=fn)

    add("tokenize", cmd_tokenize, "token ids for JSON-line texts", model=True)
    add("vocab", cmd_vocab, "special ids, attributes and pieces of every token", model=True)
    add("render", cmd_render, "chat templates rendered as transformers does", model=False)
    add("generate", cmd_generate, "greedy token ids and top-2 logits per step", model=True)
    add("perplexity", cmd_perplexity, "llama-perplexity's perplexity of texts", model=True)
    sub.choices["perplexity"].add_argument("--threads", type=int, default=2, help="threads")
    gen = sub.choices["generate"]
    gen.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    gen.add_argument("--ctx", type=int, default=4096, help="context size (a multiple of 256)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
