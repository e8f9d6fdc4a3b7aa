"""Run an app under uvicorn, and tell the user how to query it once it listens."""

from __future__ import annotations

from typing import Any

import uvicorn
from fastapi import FastAPI


class Server(uvicorn.Server):
    """uvicorn's server, printing a banner once the socket is bound."""

    def __init__(self, config: uvicorn.Config, banner: str) -> None:
        super().__init__(config)
        self.banner = banner

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.banner, flush=True)


def run(app: FastAPI, host: str, port: int, log_level: str, api_key: str | None) -> None:
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, gives open requests 5 s,
    # then the app's lifespan stops the engine thread.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), timeout_graceful_shutdown=5)
    Server(config, banner(host, port, app.state.server.model_name, api_key)).run()


def banner(host: str, port: int, model: str, api_key: str | None) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    base = f"http://{host}:{port}"
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return (
        f"\nmodserve is serving {model!r} at {base}/v1 (Ctrl-C stops it). Try:\n"
        f"  curl {base}/v1/completions{auth} -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n"
        f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='{api_key or 'none'}'); "
        f"print(c.chat.completions.create(model='{model}', max_tokens=16, "
        f"messages=[{{'role': 'user', 'content': 'Hello'}}]).choices[0].message.content)\"\n"
    )
