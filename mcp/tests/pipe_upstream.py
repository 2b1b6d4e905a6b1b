"""An upstream child process that acts on a request the proxy has not
finished writing, for the test of a broken pipe on the child's stdin.

    pipe_upstream.py --ledger FILE

It speaks MCP on stdin and stdout itself (no SDK), reading as a stream
decoder does (Go's json.Decoder, which the official Go SDK reads with):
a message is complete at the end of its JSON value, newline or not. Its
one tool, `charge`, writes each charge to the ledger before anything else.

The first charge is answered, with the length of its request (without
the newline), the request's JSON-RPC id and the capacity of the stdin
pipe: enough for the test to size the next request so that its JSON
fills the pipe exactly. The next request is the trap. Once its bytes fill
the pipe (the proxy still holds the newline, as no room is left), the
child takes them without consuming them (tee(2)), finds a whole
tools/call, writes the charge, and closes its stdin. The proxy's write
of the newline then fails with EPIPE although the charge happened. The
child keeps its stdout open, so the proxy sees the broken pipe and not an
end of stream, and exits once the proxy has closed its end of stdout.

Anything not as expected is written to the ledger as an `error` entry
(the test fails on it), and the child exits.
"""

from __future__ import annotations

import argparse
import array
import codecs
import ctypes
import fcntl
import json
import os
import select
import sys
import termios

parser = argparse.ArgumentParser()
parser.add_argument("--ledger", required=True)
args = parser.parse_args()

SPLICE_F_NONBLOCK = 2
decoder = json.JSONDecoder()
utf8 = codecs.getincrementaldecoder("utf-8")()
pending = ""  # text read from stdin, not decoded yet
charges = 0


def ledger(entry: dict) -> None:
    with open(args.ledger, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def fail(why: str) -> None:
    ledger({"tool": "error", "why": why})
    print(f"pipe_upstream: {why}", file=sys.stderr, flush=True)
    sys.exit(1)


def send(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def next_message():
    """The next JSON value on stdin, however it is split into lines, and
    its length in bytes as sent."""
    global pending
    while True:
        text = pending.lstrip()
        if text:
            try:
                message, end = decoder.raw_decode(text)
            except json.JSONDecodeError:
                pass  # not whole yet
            else:
                pending = text[end:]
                return message, len(text[:end].encode())
        chunk = os.read(0, 1 << 16)
        if not chunk:
            sys.exit(0)  # the proxy closed our stdin
        pending += utf8.decode(chunk)


def unread_bytes() -> int:
    count = array.array("i", [0])
    fcntl.ioctl(0, termios.FIONREAD, count, True)
    return count[0]


def charge(message: dict, length: int) -> None:
    params = message["params"]
    ledger({
        "tool": "charge",
        "amount": params["arguments"]["amount"],
        "attempt_id": (params.get("_meta") or {}).get("io.atmost/attempt-id"),
        "length": length,
    })


def trap() -> None:
    """The request now arriving fills the pipe with its JSON; act on it
    and close stdin before the proxy can write its newline."""
    if pending.strip():
        fail(f"unread text before the trap request: {pending[:80]!r}")
    capacity = fcntl.fcntl(0, fcntl.F_GETPIPE_SZ)
    select.select([0], [], [])
    # FIONREAD holds the pipe's lock, as the proxy's write does: the one
    # write that filled the empty pipe has finished.
    unread = unread_bytes()
    if unread != capacity:
        fail(f"the trap request left {unread} bytes in a pipe of {capacity}")
    # A copy of the pipe's bytes, leaving them in the pipe (tee(2)), so no
    # room is made for the newline.
    peek_r, peek_w = os.pipe()
    fcntl.fcntl(peek_w, fcntl.F_SETPIPE_SZ, capacity)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.tee.restype = ctypes.c_ssize_t
    copied = libc.tee(0, peek_w, ctypes.c_size_t(capacity), SPLICE_F_NONBLOCK)
    if copied != capacity:
        fail(f"tee copied {copied} of {capacity} bytes (errno {ctypes.get_errno()})")
    os.close(peek_w)
    data = b""
    while len(data) < capacity:
        data += os.read(peek_r, capacity - len(data))
    text = data.decode()
    try:
        message, end = decoder.raw_decode(text)
    except json.JSONDecodeError as e:
        fail(f"the trap request's {len(data)} bytes are not a whole JSON value: {e}")
    if end != len(text) or message.get("method") != "tools/call":
        fail(f"the pipe holds more than one tools/call: {text[end:end + 80]!r}")
    charge(message, len(data))
    # Closes the pipe's read end (fd 0 is /dev/null from here on).
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    # Stay, stdout open, until the proxy closes its end (POLLERR).
    watch = select.poll()
    watch.register(1, 0)
    watch.poll()
    sys.exit(0)


while True:
    message, length = next_message()
    method, request_id = message.get("method"), message.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": request_id, "result": {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "pipe-upstream", "version": "0"},
        }})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": request_id, "result": {"tools": [{
            "name": "charge",
            "inputSchema": {"type": "object", "properties": {"amount": {"type": "integer"}}},
        }]}})
    elif method == "tools/call":
        charge(message, length)
        charges += 1
        answer = {"length": length, "id": request_id,
                  "pipe": fcntl.fcntl(0, fcntl.F_GETPIPE_SZ)}
        send({"jsonrpc": "2.0", "id": request_id, "result": {
            "content": [{"type": "text", "text": json.dumps(answer)}],
        }})
        if charges == 1:
            trap()
    elif request_id is not None:
        send({"jsonrpc": "2.0", "id": request_id,
              "error": {"code": -32601, "message": f"no method {method}"}})
