"""Serve a local model through an OpenAI-compatible chat-completions endpoint.

    python -m recipes.serve --model smollm2-135m --port 8000
    python -m recipes.serve --model runs/x/hf --port 8001 --api-key-env LITCTX_API_KEY

Any pipeline then reaches it with the HTTP backend, e.g.
``method.args.backend='{name: openai, base_url: http://127.0.0.1:8000/v1, model: smollm2-135m}'``, and several
processes share one loaded model. It listens on 127.0.0.1 unless ``--host`` says otherwise (then set
``--api-key-env``). Routes: ``POST /v1/chat/completions``, ``GET /v1/models`` (and ``/v1/models/{id}``),
``GET /health``. The security model (hosts, origins, body size, queue): ``docs/memory.md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from recipes.cli import guarded
from recipes.config import ConfigError

__all__ = ["main"]


@guarded
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.serve", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m, gemma3-270m, a Hugging Face model folder, or tiny-llama (default: %(default)s)")
    parser.add_argument("--name", default=None, help="the model name clients send (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", help="weights' dtype (default: %(default)s)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="prompt + reply tokens allowed (default: the model's)")
    parser.add_argument("--api-key-env", default=None, metavar="VAR",
                        help="require 'Authorization: Bearer $VAR' on every request (the key is never printed)")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="a Host name to answer besides the loopback ones (repeat; '*': any). On a loopback "
                             "address only loopback names are answered (DNS rebinding)")
    parser.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                        help="a browser Origin (scheme://host[:port]) allowed besides loopback origins (repeat)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    from lightning_modules.llm.serving.chat_server import ServingLimits, build_app, is_loopback

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port}: must be in 1..65535")
    if args.api_key_env and not os.environ.get(args.api_key_env):
        raise ConfigError(f"--api-key-env {args.api_key_env}: the variable is not set (export it first)")
    if not is_loopback(args.host) and not args.api_key_env:
        print(f"litctx serve: warning: listening on {args.host} without --api-key-env: anyone who can reach this "
              f"address can use the model", file=sys.stderr)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s %(message)s")

    import uvicorn

    from lightning_modules.llm.serving.chat import LocalChatBackend

    try:
        backend = LocalChatBackend(args.model, dtype=args.dtype, max_context=args.max_context)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"--model {args.model}: {err}") from None
    name = args.name or args.model
    limits = ServingLimits(bind_host=args.host, allowed_hosts=tuple(args.allowed_host),
                           allowed_origins=tuple(args.allowed_origin))
    app = build_app(backend, name, api_key_env=args.api_key_env, limits=limits)
    print(f"litctx serve: {name} ({backend.identity}, context {backend.max_context} tokens) at "
          f"http://{args.host}:{args.port}/v1  (POST /v1/chat/completions; Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
