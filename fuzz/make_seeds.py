#!/usr/bin/env python3
"""Writes the starting corpus of each fuzz target into fuzz/corpus/<target>/ from the repository's
fixtures and shipped model pair (see harness.rs for the input formats). After fuzzing, the corpus is
minimized (`cargo fuzz cmin`) and the result kept in fuzz/seeds/<target>/."""
import hashlib, json, struct, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "fuzz" / "corpus"


def chunks(*parts):
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def put(target, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / hashlib.sha1(data).hexdigest()).write_bytes(data)


def read(p):
    p = ROOT / p
    return p.read_bytes() if p.exists() else b""


def safetensors(tensors, dtype_override=None):
    """tensors: {name: (dtype, shape)}; data is zeros (i64 tensors count up)."""
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "F64": 8, "I32": 4, "U8": 1, "BOOL": 1}
    header, data, off = {}, b"", 0
    for name, (dt, shape) in tensors.items():
        n = 1
        for s in shape:
            n *= s
        if dt == "I64":
            blob = b"".join(struct.pack("<q", i) for i in range(n))
        else:
            blob = bytes(n * sizes[dt])
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(blob)]}
        data += blob
        off += len(blob)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def fixture_header(p):
    b = (ROOT / p).read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8 : 8 + n])
    h.pop("__metadata__", None)
    return h


# (a) config: target config, assistant config, generation config.
targets = sorted(ROOT.glob("tests/fixtures/t*/config.json")) + [ROOT / "models/default/target/config.json",
                                                                  ROOT / "tests/fixtures/text-tiny/config.json"]
drafts = [ROOT / p for p in ["tests/fixtures/d1-centroid/config.json", "tests/fixtures/d2-tied/config.json",
                             "models/default/assistant/config.json", "tests/fixtures/text-tiny-assistant/config.json"]]
for i, t in enumerate(targets):
    gen = t.parent / "generation_config.json"
    put("config", chunks(t.read_bytes(), drafts[i % len(drafts)].read_bytes(), gen.read_bytes() if gen.exists() else b""))
put("config", chunks(read("models/default/target/config.json"), read("models/default/assistant/config.json")))

# (b) weights: fixture headers with tiny shapes, one file and an index over two shards.
for p in ["tests/fixtures/t1-bf16/model.safetensors", "tests/fixtures/d1-centroid/model.safetensors",
          "tests/fixtures/t4-unified/model.safetensors"]:
    h = fixture_header(p)
    small = {k: (v["dtype"], [min(s, 2) for s in v["shape"]]) for k, v in list(h.items())[:12]}
    for k, v in h.items():
        if k.endswith("embed_tokens.weight"):
            small[k] = (v["dtype"], [4, 2])
    put("weights", chunks(b"", safetensors(small)))
names = {"model.embed_tokens.weight": ("BF16", [4, 2]), "model.norm.weight": ("BF16", [2]),
         "model.layers.0.layer_scalar": ("BF16", [1]), "masked_embedding.token_ordering": ("I64", [4])}
a = dict(list(names.items())[:2])
b = dict(list(names.items())[2:])
index = {"metadata": {}, "weight_map": {**{k: "model.safetensors" for k in a}, **{k: "model-00002.safetensors" for k in b}}}
put("weights", chunks(json.dumps(index).encode(), safetensors(a), safetensors(b)))
put("weights", chunks(b"", safetensors({"embed_tokens.weight": ("F32", [3, 2]), "x": ("F64", [1]), "y": ("U8", [3])})))

# (c) template: the repository's templates and a few constructs hostile templates use.
for p in ["models/default/target/chat_template.jinja", "tests/fixtures/text-tiny/chat_template.jinja"]:
    put("template", read(p))
for s in [
    "{% for m in messages %}{{ loop.cycle('a', 'b') }}{{ loop.index }}{% endfor %}",
    "{% set ns = namespace(a=1, l=[]) %}{% for m in messages %}{% set ns.l = ns.l + [m.role] %}{% endfor %}{{ ns.l|join(',') }}",
    "{% macro f(x) %}{{ x|tojson(indent=2) }}{% endmacro %}{{ f(tools) }}{{ messages|map(attribute='content')|list }}",
    "{{ '{:>8}'.format('x') ~ ' %5.2f'|format(1.5) }}{{ 'a b'.split()|batch(2)|list }}{{ range(5)|slice(2)|list }}",
    "{{ bos_token }}{% for m in messages if m.role != 'system' %}{{ m.content|trim|indent(2) }}{% endfor %}",
    "{{ (messages|first).content * 3 }}{{ messages|dictsort if false else messages|length }}{{ strftime_now('%Y') }}",
    "{% generation %}{{ raise_exception('x') if messages|length > 100 }}{% endgeneration %}",
]:
    put("template", s.encode())

# (c) tokenizer: the text fixture's files, and a minimal word-level tokenizer.
put("tokenizer", chunks(read("tests/fixtures/text-tiny/tokenizer_config.json"), read("tests/fixtures/text-tiny/tokenizer.json"),
                        read("tests/fixtures/text-tiny/chat_template.jinja")))
wl = {"version": "1.0", "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<bos>": 1, "hi": 2}, "unk_token": "<unk>"},
      "pre_tokenizer": {"type": "Whitespace"}, "added_tokens": [], "normalizer": None, "post_processor": None, "decoder": None}
put("tokenizer", chunks(json.dumps({"bos_token": "<bos>", "chat_template": "{{ bos_token }}{{ messages[0].content }}"}).encode(),
                        json.dumps(wl).encode()))
bpe = {"version": "1.0", "model": {"type": "BPE", "vocab": {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "<0x41>": 4},
       "merges": ["a b"], "unk_token": "<unk>", "byte_fallback": True}, "added_tokens": [{"id": 5, "content": "<bos>",
       "special": True, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}],
       "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": {"type": "ByteFallback"}}
put("tokenizer", chunks(json.dumps({"tokenizer_class": "GemmaTokenizer", "added_tokens_decoder": {"5": {"content": "<bos>", "special": True}},
                                    "extra_special_tokens": {"eot_token": "<eot>"}}).encode(), json.dumps(bpe).encode()))

# (d) messages.
for m in [
    [{"role": "user", "content": "def f(x):\n    return x"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "<channel|>ok", "reasoning_content": "r"}],
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}], "add_generation_prompt": True, "enable_thinking": True},
    {"messages": [{"role": "user", "content": "w?"}, {"role": "assistant", "tool_calls": [{"function": {"name": "get", "arguments": {"b": [1, 2.5, None], "a": {"x": "y"}}}}]},
                  {"role": "tool", "content": "sunny"}], "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]},
    [{"role": "developer", "content": None}, {"role": "narrator", "content": 3}],
]:
    put("messages", json.dumps(m, ensure_ascii=False).encode())

# (e) params: ids, seed, top-k, temperature, top-p, min-p, repeat penalty, draft tokens, stop.
for p in ["2,17,33\n42\n40\n0.8\n0.95\n0.05\n1.1\n4\n\\n\\n", "1\n-1\n-1\n1\n1\n0\n1\nauto\nEND", "5, 6,\n0\n0\n0\n1\n0\n1\n1\nx",
          "1,2\n18446744073709551615\n1\n1e-4\n1e-30\n1\n100\n16\n<eos>", "\n\n\nnan\ninf\n-0\n1e39\n0\n"]:
    put("params", p.encode())

# (f) requests: a selector byte (bit 0: completions, bit 1: the text fixture, bit 2: no tools in the
# splitter), then a request body for tandem serve.
for sel, body in [
    (0, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 3,
         "stop": ["\n"], "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}),
    (0, {"model": "tandem", "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": "x"}], "draft_tokens": "auto", "presence_penalty": 1, "frequency_penalty": -1,
         "logit_bias": {"5": -100, "7": 3}, "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.2, "n": 1}),
    (2, {"messages": [{"role": "user", "content": "w?"}, {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"a\": [1, 2.5]}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "{\"t\": 21}"}],
         "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}],
         "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": True}}),
    (1, {"prompt": "def f(x):", "max_tokens": 4, "logprobs": 3, "echo": False, "best_of": 1}),
    (3, {"prompt": [[2, 5, 9]], "max_tokens": 2, "draft_tokens": 0}),
    (0, {"messages": [], "n": 2, "response_format": {"type": "json_object"}, "temperature": "hot"}),
]:
    put("requests", bytes([sel]) + json.dumps(body).encode())
put("requests", bytes([0]) + '<|channel>thought\nhm<channel|>ok<|tool_call>call:f{a:<|"|>x<|"|>,b:[1,{c:true}]}<tool_call|>'.encode())
