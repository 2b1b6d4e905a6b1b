"""The upstream MCP server of the tests: the official Python SDK's
MCPServer (FastMCP), over Streamable HTTP or stdio.

Every tool that has a side effect first appends one JSON line to the
ledger file (--ledger): the upstream's own count of what it did, which the
tests hold against the permit's cap. Nothing in the proxy or atmost writes
it.

    upstream.py --ledger FILE [--port N | --stdio] [--release DIR] [--tls-cert PEM --tls-key PEM]

Over HTTP it binds 127.0.0.1 on --port (0: a port the system picks) and
prints `upstream listening on http://127.0.0.1:PORT/mcp` (https with
--tls-cert) once it serves.
`charge` with `hold` answers once a file of that name appears in --release.

Over HTTP the test can also make it lose its sessions as an upstream does
that restarted, evicted them, or is a replica that never had them, while
the calls in them run on (POST /control/forget-sessions: from then on a
request naming one of them is answered 404, while the calls already
running go on answering on their response streams), then end those calls
without an answer (POST /control/end-forgotten: their streams closed, as
when the process holding them goes away). Each answers how many sessions
it acted on.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import sys
import uuid

import anyio
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.responses import JSONResponse

parser = argparse.ArgumentParser()
parser.add_argument("--ledger", required=True)
parser.add_argument("--port", type=int, default=0)
parser.add_argument("--stdio", action="store_true")
parser.add_argument("--release", default=None)
parser.add_argument("--tls-cert", default=None, help="serve https with this certificate (PEM)")
parser.add_argument("--tls-key", default=None, help="the private key of --tls-cert (PEM)")
args = parser.parse_args()

server = MCPServer("ledger-upstream", instructions="A wallet whose every charge is written down.")


def record(tool: str, ctx: Context, **fields) -> str:
    """One line in the ledger, written before the tool's answer; its id."""
    meta = dict(ctx.request_context.meta or {})
    entry_id = uuid.uuid4().hex
    line = {"id": entry_id, "tool": tool, "attempt_id": meta.get("io.atmost/attempt-id"), **fields}
    with open(args.ledger, "a", encoding="utf-8") as ledger:
        ledger.write(json.dumps(line) + "\n")
        ledger.flush()
        os.fsync(ledger.fileno())
    return entry_id


@server.tool()
async def charge(amount: int, ctx: Context, hold: str = "") -> dict:
    """Charge the wallet: a side effect, written down. With `hold`, the
    answer waits until the test releases that label (or forever)."""
    entry = record("charge", ctx, amount=amount, hold=hold)
    if hold:
        release = pathlib.Path(args.release or "/nonexistent") / hold
        while not release.exists():
            await anyio.sleep(0.02)
    return {"charged": amount, "tx": entry}


@server.tool()
def refuse(why: str, ctx: Context) -> str:
    """Always refused by the wallet (an isError result), after writing down the try."""
    record("refuse", ctx, why=why)
    raise ValueError(f"declined: {why}")


@server.tool()
def crash(ctx: Context) -> str:
    """Written down, then the whole upstream process exits without answering."""
    record("crash", ctx)
    os._exit(3)


@server.tool()
def echo(text: str) -> str:
    """No side effect: says the text back."""
    return text


#: Sessions forgotten by /control/forget-sessions, still running.
forgotten = []


@server.custom_route("/control/forget-sessions", methods=["POST"])
async def forget_sessions(request: Request) -> JSONResponse:
    # The SDK's own session table (StreamableHTTPSessionManager): a session
    # not in it is answered 404, which is what the manager does itself for
    # one it ended or never had. The transports are kept: their calls run on.
    sessions = server.session_manager._server_instances
    forgotten.extend(sessions.values())
    count = len(sessions)
    sessions.clear()
    server.session_manager._session_owners.clear()
    return JSONResponse({"sessions": count})


@server.custom_route("/control/end-forgotten", methods=["POST"])
async def end_forgotten(request: Request) -> JSONResponse:
    count = len(forgotten)
    while forgotten:
        await forgotten.pop().terminate()
    return JSONResponse({"sessions": count})


def serve_http() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    port = sock.getsockname()[1]
    app = server.streamable_http_app(
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False)
    )
    tls = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key} if args.tls_cert else {}
    scheme = "https" if args.tls_cert else "http"
    config = uvicorn.Config(app, log_level="warning", **tls)
    uv = uvicorn.Server(config)

    async def main() -> None:
        # Said once the socket listens: the proxy may connect right away.
        sock.listen(128)
        print(f"upstream listening on {scheme}://127.0.0.1:{port}/mcp", flush=True)
        await uv.serve(sockets=[sock])

    anyio.run(main)


if args.stdio:
    server.run("stdio")
else:
    serve_http()
