"""Regeneration client: runs ON the GPU host (stdlib only, Python 3.8+), beside the server, so that
the deployed target writes a chat dataset's assistant turns (as SpecForge's
`scripts/regenerate_train_data.py` does, against the server the host already serves).  A
subclass of the on-host client skeleton (`client.py`, shipped beside it: queue, retries,
counters, progress log, manifest, resume by key, `count` / `done-keys`).

Its dataset is a shard written by `remote-ops dataset regenerate`: one JSON line per chat,
`{"id", "key", "messages": [{"role", "content"}]}`, checked and keyed on the laptop
(`remote_ops.core.regenplan`: the key hashes the prompt turns and the sampling parameters).  For
every chat it walks the turns in order, as SpecForge's script does: system turns are kept, the
source's assistant turns are dropped, and after each user turn the conversation so far (with the
replies regenerated so far) goes to the server's `/v1/chat/completions`, so the server renders it
with the model's own chat template; the answer becomes the next assistant turn (with its
`reasoning_content` when the server's reasoning parser returns one).  Sampling: `--temperature`,
`--top-p` (sent only when given), `--max-tokens`.  Each request is retried as the skeleton
retries; a chat that fails gets a `failed` manifest line and no record.

- `<workdir>/regenerated.jsonl`: one O_APPEND line per regenerated chat, `{"id", "source_key",
  "messages", "regenerated": {...}}`, written BEFORE the chat's `ok` line in the manifest
  (`tokens` = the chat's completion tokens; the log's counters add `prompt_tokens`).
- `records --workdir W` prints the output lines of the keys given on stdin, one a line (what
  the laptop pulls and merges).
"""

import collections
import json
import os
import sys
import threading

try:  # imported as remote_ops.onhost.regenerate_onhost (tests, the laptop)
    from . import client as base
except ImportError:  # run as a script on the host (or loaded from its file): the skeleton is beside it
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    import client as base  # type: ignore[import-not-found,no-redef]

OUTPUT_NAME = "regenerated.jsonl"
CHAT_PATH = "/v1/chat/completions"
DESCRIPTION = __doc__.split("\n")[0]


Chat = collections.namedtuple("Chat", "id key messages")  # one shard line: the source id, its key, its turns


def read_shard(path):
    """[Chat] of a shard; a line the laptop would not have written raises base.DatasetError."""
    return [
        Chat(doc.get("id", index), doc["key"], doc["messages"]) for doc, index in base.read_lines(path, shard_problem)
    ]


def shard_problem(doc):
    if not isinstance(doc.get("key"), str) or not doc["key"]:
        return "not a shard line ({id, key, messages}: written by remote-ops dataset regenerate)"
    turns = doc.get("messages")
    if not isinstance(turns, list) or not turns:
        return "messages must be a non-empty list"
    for turn in turns:
        if not isinstance(turn, dict) or turn.get("role") not in ("system", "user", "assistant"):
            return "each turn needs a role: system, user or assistant"
        if not isinstance(turn.get("content"), str):
            return "each turn's content is a string"
    return None


def sampling_of(args):
    """The request's sampling fields (top_p only when given, as SpecForge's script)."""
    out = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    if args.top_p is not None:
        out["top_p"] = args.top_p
    return out


def reply_of(answer):
    """(assistant turn, finish_reason, completion tokens, prompt tokens, model) of a chat answer;
    ValueError when it has no choices[0].message."""
    try:
        choice = answer["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("the answer has no choices[0].message: %s" % (json.dumps(answer)[:200],)) from None
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError("choices[0].message.content is not text")
    turn = {"role": "assistant", "content": content or ""}
    if isinstance(message.get("reasoning_content"), str):
        turn["reasoning_content"] = message["reasoning_content"]
    usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
    return (
        turn,
        choice.get("finish_reason"),
        int(usage.get("completion_tokens") or 0),
        int(usage.get("prompt_tokens") or 0),
        answer.get("model"),
    )


def regenerate(messages, ask):
    """The chat with every assistant turn written by `ask(conversation so far)` (SpecForge's walk:
    system turns kept, source replies dropped, one request after each user turn); returns
    (messages, meta)."""
    out, reasons, completion, prompt, model, standin = [], [], 0, 0, None, False
    for turn in messages:
        if turn["role"] == "assistant":
            continue
        out.append({"role": turn["role"], "content": turn["content"]})
        if turn["role"] != "user":
            continue
        answer = ask(out)
        reply, reason, c_tokens, p_tokens, model = reply_of(answer)
        standin = standin or answer.get("standin") is True
        out.append(reply)
        reasons.append(reason)
        completion, prompt = completion + c_tokens, prompt + p_tokens
    meta = {"finish_reasons": reasons, "completion_tokens": completion, "prompt_tokens": prompt, "model": model}
    if standin:
        meta["standin"] = True  # the sandbox's stand-in server wrote these turns, not a model
    return out, meta


class Run(base.Run):
    """One regeneration session: the skeleton's run over the chats of a shard."""

    prog, description = "regenerate_onhost", DESCRIPTION
    counter_names = base.Run.counter_names + ("prompt_tokens",)

    def __init__(self, args, chats, records, dataset_id):
        self.url = args.server.rstrip("/") + CHAT_PATH
        self.output = args.output or os.path.join(args.workdir, OUTPUT_NAME)
        self.wlock = threading.Lock()
        self.prompt_tokens = 0
        base.Run.__init__(self, args, chats, records, dataset_id)

    @classmethod
    def read(cls, args):
        return read_shard(args.dataset)

    @staticmethod
    def key_of(chat):
        return chat.key

    def started_fields(self):
        return {"sampling": json.dumps(sampling_of(self.args), sort_keys=True)}

    def one(self, chat):
        """Regenerate one chat; its record, then its manifest line (an interrupted chat: neither)."""
        attempts = []
        sampling = sampling_of(self.args)

        def ask(conversation):
            body = dict(sampling, messages=conversation, stream=False)
            answer, n = self.attempt(lambda: base.post_json(self.url, body, self.args.request_timeout), chat.id)
            attempts.append(n)
            return answer

        try:
            messages, meta = regenerate(chat.messages, ask)
        except (ValueError, base.GaveUp) as exc:
            if self.stop.is_set() or getattr(exc, "interrupted", False):
                return  # interrupted: sent again by the next run
            return self.record(chat.id, chat.key, 0, "failed", sum(attempts) + getattr(exc, "attempts", 1), str(exc))
        meta["sampling"] = sampling
        rec = {"id": chat.id, "source_key": chat.key, "messages": messages, "regenerated": meta}
        base.append_line(self.output, rec, self.wlock)
        with self.lock:
            self.prompt_tokens += meta["prompt_tokens"]
        self.record(chat.id, chat.key, meta["completion_tokens"], "ok", sum(attempts))

    @classmethod
    def add_arguments(cls, ap):
        ap.add_argument("--output", default=None, help="default <workdir>/" + OUTPUT_NAME)
        ap.add_argument("--temperature", type=float, default=0.7)
        ap.add_argument("--top-p", type=float, default=None)
        ap.add_argument("--max-tokens", type=int, default=4096, help="per assistant turn")
        ap.set_defaults(concurrency=64, request_timeout=3600.0)  # chats in flight; a chat's turns take long

    @classmethod
    def workdir_commands(cls):
        def print_records(workdir):
            records(workdir, {line.strip() for line in sys.stdin if line.strip()}, sys.stdout.buffer)

        return dict(base.Run.workdir_commands(), records=print_records)


def records(workdir, wanted, out):
    """Write the output lines of the `wanted` keys (the last line of each) to `out`."""
    found = {}
    for raw, rec in base.json_lines(os.path.join(workdir, OUTPUT_NAME)):
        if rec.get("source_key") in wanted:
            found[rec["source_key"]] = raw.rstrip(b"\n")
    for line in found.values():
        out.write(line + b"\n")
    return len(found)


main = Run.main

if __name__ == "__main__":
    sys.exit(main())
