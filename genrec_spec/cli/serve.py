"""The online retrieval service: ``genrec-spec serve`` (FastAPI on uvicorn).

    genrec-spec serve --ckpt CKPT [--data DIR] [--llm smollm2] --host 127.0.0.1 --port 8080 \\
        [--api-key KEY | env GENREC_SPEC_API_KEY] [--max-batch 32] [--max-wait-ms 5] \\
        [--max-queue 256] [--timeout-s 5]

    curl -s localhost:8080/v1/recommend -H 'content-type: application/json' \\
        -d '{"user_id": "196", "k": 10, "decoder": "heads"}'

The recommender is loaded before the server starts (a bad checkpoint or data folder is a clear
error and exit code 2); the LLM (``--llm``) loads in the background after start-up, and
/readyz answers 503 until it is ready. Concurrent /v1/recommend requests of the same decoder, k
and options are decoded together (up to --max-batch requests; the first waits for the load at
hand, the last such batch's clients and those then waiting, at most --max-wait-ms), in one model
worker thread. More than --max-queue waiting requests
are refused with 503 and Retry-After; a request unanswered after --timeout-s gets 504. With an
API key (``--api-key`` or the environment variable GENREC_SPEC_API_KEY) every /v1/* request
needs the header ``X-API-Key``; /healthz, /readyz and /metrics stay open. Endpoints and errors:
`genrec_spec.serve.app`; the schema is served at /openapi.json (and /docs).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from genrec_spec.serve.config import API_KEY_ENV, ServeConfig
    from genrec_spec.serve.generation import LLMS

    c = ServeConfig()
    parser.add_argument("--ckpt", required=True, type=Path, help="checkpoint folder (train)")
    parser.add_argument("--data", type=Path, help="prepared data (default: the trained-on one)")
    parser.add_argument("--llm", choices=LLMS, help="also serve /v1/generate with this LLM")
    parser.add_argument("--host", default=c.host, help="bind address")
    parser.add_argument("--port", type=int, default=c.port)
    parser.add_argument("--api-key", help=f"require X-API-Key on /v1/* (default: ${API_KEY_ENV})")
    parser.add_argument("--max-batch", type=int, default=c.max_batch, help="requests per call")
    parser.add_argument("--max-wait-ms", type=float, default=c.max_wait_ms, help="batch window")
    parser.add_argument("--max-queue", type=int, default=c.max_queue, help="waiting requests")
    parser.add_argument("--timeout-s", type=float, default=c.timeout_s, help="per request")
    parser.add_argument("--max-k", type=int, default=c.max_k, help="longest list a request gets")
    parser.add_argument(
        "--max-body-bytes", type=int, default=c.max_body_bytes, help="larger bodies get 413"
    )
    parser.add_argument("--threads", type=int, default=c.threads, help="torch CPU threads")
    parser.add_argument(
        "--history-cache-mb",
        type=int,
        default=c.history_cache_mb,
        help="encoded user histories kept across requests, MiB (0: off)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    parser.add_argument("--access-log", action="store_true", help="log every request")


def run(args: argparse.Namespace) -> int:
    from genrec_spec.cli.args import config_from_args
    from genrec_spec.serve.app import run_service
    from genrec_spec.serve.config import API_KEY_ENV, ServeConfig

    config = config_from_args(
        ServeConfig, args, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None
    )
    run_service(
        config,
        args.ckpt,
        args.data,
        args.llm,
        log_level=args.log_level,
        access_log=args.access_log,
    )
    return 0
