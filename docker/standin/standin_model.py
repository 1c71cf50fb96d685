#!/usr/bin/env python3
"""STAND-IN model: the tiny real network the SGLang stand-in server computes (NOT Kimi-K2.5).

The network (float64 on the CPU, numpy):

    x   = embed_tokens[ids]                                         [n, H]
    for each layer i (the residual stream entering layer i is what SGLang captures at layers_to_capture = i):
        a = RMSNorm(x, input_layernorm)
        x = x + o_proj . (running mean of a over positions 0..t)    token mixing: causal, uniform weights
        m = RMSNorm(x, post_attention_layernorm)
        x = x + down_proj . (silu(gate_proj . m) * (up_proj . m))   SwiGLU MLP
    final = RMSNorm(x, norm)                                        the post-norm final state
    logits = lm_head . bf16(final[last])                            (the embedding when tie_word_embeddings)

The token mixing is attention with uniform weights (a causal running mean, O(n) per layer), not
softmax attention: it makes every position depend on the prompt before it, at a cost the sandbox's
two cores can pay for prompts of a few thousand tokens.  What a dump or an answer carries is rounded
once to bfloat16 (the model dtype): the dump's states, and the final state the logits are taken from,
so that `lm_head . dump's final state` gives the server's token exactly.

The weights are bfloat16 safetensors in a Hugging Face layout: `config.json`, two shards and
`model.safetensors.index.json` whose `weight_map` names each tensor's shard (the second shard holds
`model.norm.weight` and `lm_head.weight`, so a reader can take `lm_head.weight` alone).  They are
made from a seed by the standard library only (SHAKE-256 bytes mapped onto bf16 bit patterns: sign
random, exponent from a fixed range, mantissa random), so `remote-ops sandbox up` writes them on a
laptop without numpy; numpy is needed only to compute (`Network`).
"""

import hashlib
import json
import os
import struct

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 8,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "standin": True,
    "standin_seed": 0,
    "standin_network": (
        "STAND-IN: embedding; per layer RMSNorm -> causal running mean -> o_proj (+), "
        "RMSNorm -> SwiGLU MLP (+); final RMSNorm; lm_head"
    ),
}
INDEX_NAME = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
BF16 = "BF16"


# -- weights from a seed (stdlib) -------------------------------------------------------------------
def weight_specs(cfg):
    """[(name, shape, low exponent, octaves, signed, shard)]: every tensor of the network.

    Values have magnitudes in [2**low, 2**(low + octaves)) and a random sign unless unsigned (the
    norms' weights, spread over 4 octaves like a trained model's, so that pre- and post-norm final
    states give different tokens)."""
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    specs = [("model.embed_tokens.weight", [v, h], -1, 1, True, 0)]
    for k in range(n):
        p = "model.layers.%d." % k
        specs += [
            (p + "input_layernorm.weight", [h], -3, 4, False, 0),
            (p + "token_mix.o_proj.weight", [h, h], -4, 1, True, 0),
            (p + "post_attention_layernorm.weight", [h], -3, 4, False, 0),
            (p + "mlp.gate_proj.weight", [i, h], -4, 1, True, 0),
            (p + "mlp.up_proj.weight", [i, h], -4, 1, True, 0),
            (p + "mlp.down_proj.weight", [h, i], -5, 1, True, 0),
        ]
    specs.append(("model.norm.weight", [h], -3, 4, False, 1))
    if not cfg.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", [v, h], -4, 1, True, 1))
    return specs


def seeded_bf16(seed, name, count, low, octaves=1, signed=True):
    """`count` bf16 values (little-endian bytes) for tensor `name`, deterministic in the seed.

    bf16 = sign | 8 exponent bits | 7 mantissa bits; the low byte holds the exponent's last bit and
    the mantissa, the high byte the sign and the exponent's upper 7 bits.  One octave: the exponent is
    fixed (127 + low); four octaves: its upper bits take two values and its last bit is random."""
    if octaves not in (1, 4) or (octaves == 4 and (127 + low) % 2):
        raise ValueError("octaves is 1, or 4 from an even biased exponent")
    exp = 127 + low
    raw = hashlib.shake_256(("standin:%s:%s" % (seed, name)).encode()).digest(2 * count)
    if octaves == 1:
        lo = bytes(((exp & 1) << 7) | (b & 0x7F) for b in range(256))
        hi = bytes(((b & 0x80) if signed else 0) | (exp >> 1) for b in range(256))
    else:
        lo = bytes(b for b in range(256))  # exponent's last bit = the byte's top bit: random
        hi = bytes(((b & 0x80) if signed else 0) | ((exp >> 1) + (b & 1)) for b in range(256))
    out = bytearray(2 * count)
    out[0::2] = raw[0::2].translate(lo)
    out[1::2] = raw[1::2].translate(hi)
    return bytes(out)


def seeded_weights(cfg):
    """{name: (shape, bf16 bytes, shard index)} made from `cfg["standin_seed"]`."""
    seed = cfg.get("standin_seed", 0)
    out = {}
    for name, shape, low, octaves, signed, shard in weight_specs(cfg):
        count = 1
        for d in shape:
            count *= d
        out[name] = (shape, seeded_bf16(seed, name, count, low, octaves, signed), shard)
    return out


# -- safetensors (stdlib) ---------------------------------------------------------------------------
def safetensors_bytes(tensors, metadata=None):
    """A safetensors file: 8-byte LE header length, JSON header padded with spaces to 8, data."""
    header, offset = {}, 0
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": BF16, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    if metadata:
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(data for _, data in tensors.values())


def _write_atomic(path, data):
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def write_model(model_dir, cfg):
    """config.json + two bf16 shards + the index, in `model_dir` (each file replaced atomically).
    Returns the config written."""
    cfg = dict(CONFIG, **cfg)
    os.makedirs(model_dir, exist_ok=True)
    weights = seeded_weights(cfg)
    weight_map, total = {}, 0
    for k, shard in enumerate(SHARDS):
        tensors = {n: (shape, data) for n, (shape, data, s) in weights.items() if s == k}
        body = safetensors_bytes(tensors, {"format": "pt", "standin": "true"})
        _write_atomic(os.path.join(model_dir, shard), body)
        weight_map.update({n: shard for n in tensors})
        total += sum(len(d) for _, d in tensors.values())
    index = {"metadata": {"total_size": total, "standin": True}, "weight_map": weight_map}
    _write_atomic(os.path.join(model_dir, INDEX_NAME), (json.dumps(index, indent=2) + "\n").encode())
    _write_atomic(os.path.join(model_dir, "config.json"), (json.dumps(cfg, indent=2) + "\n").encode())
    return cfg


def read_config(model_dir):
    """The model's config.json over the stand-in defaults (defaults alone when there is none)."""
    cfg = dict(CONFIG)
    path = os.path.join(model_dir or "", "config.json")
    if model_dir and os.path.isfile(path):
        with open(path) as fh:
            cfg.update(json.load(fh))
    return cfg


def read_tensor(model_dir, name):
    """(dtype, shape, bytes) of one tensor, found through the index: only its shard's header and its
    own bytes are read (how an audit reads `lm_head.weight` without loading the model)."""
    with open(os.path.join(model_dir, INDEX_NAME)) as fh:
        shard = json.load(fh)["weight_map"][name]
    with open(os.path.join(model_dir, shard), "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        entry = json.loads(fh.read(size))[name]
        start, end = entry["data_offsets"]
        fh.seek(8 + size + start)
        return entry["dtype"], entry["shape"], fh.read(end - start)


def has_weights(model_dir):
    return bool(model_dir) and os.path.isfile(os.path.join(model_dir, INDEX_NAME))


# -- the network (numpy) ----------------------------------------------------------------------------
def bf16_to_f64(np, data, shape):
    """bf16 bytes -> float64 array (exact)."""
    bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).astype(np.float64).reshape(shape)


def round_bf16(np, x):
    """float64 -> bf16 bit patterns (uint16), as torch rounds: to float32, then to nearest even."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    out[np.isnan(f)] = 0x7FC0
    return out


def bf16_values(np, patterns):
    """bf16 bit patterns -> float64."""
    return (patterns.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


class Cache:
    """Where a sequence stands: each layer's running sum of normed states, and the token count."""

    def __init__(self, sums, count):
        self.sums, self.count = sums, count


class Network:
    """The STAND-IN network over float64 copies of its bf16 weights."""

    def __init__(self, cfg, tensors):
        import numpy as np

        self.np, self.cfg = np, cfg
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.vocab = int(cfg["vocab_size"])
        self.hidden = int(cfg["hidden_size"])
        w = {name: bf16_to_f64(np, data, shape) for name, (shape, data) in tensors.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        self.layers = []
        for k in range(int(cfg["num_hidden_layers"])):
            p = "model.layers.%d." % k
            self.layers.append(
                tuple(
                    w[p + n]
                    for n in (
                        "input_layernorm.weight",
                        "token_mix.o_proj.weight",
                        "post_attention_layernorm.weight",
                        "mlp.gate_proj.weight",
                        "mlp.up_proj.weight",
                        "mlp.down_proj.weight",
                    )
                )
            )

    @classmethod
    def load(cls, model_dir):
        """From the model dir's safetensors (through the index), or from the seed when it has none.
        Returns (network, where the weights came from)."""
        cfg = read_config(model_dir)
        if has_weights(model_dir):
            names = [s[0] for s in weight_specs(cfg)]
            tensors = {}
            for name in names:
                dtype, shape, data = read_tensor(model_dir, name)
                if dtype != BF16:
                    raise ValueError("%s: dtype %s, the stand-in reads BF16" % (name, dtype))
                tensors[name] = (shape, data)
            return cls(cfg, tensors), os.path.join(model_dir, INDEX_NAME)
        tensors = {n: (shape, data) for n, (shape, data, _) in seeded_weights(cfg).items()}
        return cls(cfg, tensors), "seed %s in memory (no %s in %s)" % (
            cfg.get("standin_seed", 0),
            INDEX_NAME,
            model_dir,
        )

    def rmsnorm(self, x, weight):
        np = self.np
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def forward(self, ids, capture=(), cache=None):
        """Run `ids` on from `cache` (None: a new sequence).

        Returns ({layer: residual stream entering it, [n, H]}, pre-norm final [n, H], post-norm final
        [n, H], the cache after the last id); all float64."""
        np = self.np
        x = self.embed[np.asarray(ids, dtype=np.int64)]
        start = cache.count if cache else 0
        counts = np.arange(start + 1, start + len(ids) + 1, dtype=np.float64)[:, None]
        states, sums = {}, []
        for k, (w_in, o_proj, w_post, gate, up, down) in enumerate(self.layers):
            if k in capture:
                states[k] = x
            a = np.cumsum(self.rmsnorm(x, w_in), axis=0)
            if cache:
                a += cache.sums[k]
            sums.append(a[-1].copy())
            x = x + (a / counts) @ o_proj.T
            m = self.rmsnorm(x, w_post)
            g = m @ gate.T
            x = x + ((g / (1.0 + np.exp(-g))) * (m @ up.T)) @ down.T
        return states, x, self.rmsnorm(x, self.norm), Cache(sums, start + len(ids))

    def next_token(self, final_row):
        """argmax of lm_head . bf16(final state of the last position) (first index on a tie)."""
        np = self.np
        return int(np.argmax(self.lm_head @ bf16_values(np, round_bf16(np, final_row))))

    def generate(self, ids, max_new, capture=()):
        """Greedy decoding: (captured states, pre-norm final, post-norm final of the prompt, new ids)."""
        states, pre, post, cache = self.forward(ids, capture)
        out = []
        row = post[-1]
        for _ in range(max_new):
            out.append(self.next_token(row))
            if len(out) < max_new:
                _, _, step, cache = self.forward([out[-1]], (), cache)
                row = step[-1]
        return states, pre, post, out
