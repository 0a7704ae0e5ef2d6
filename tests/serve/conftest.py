"""A real service for the tests: uvicorn serving `create_app` in a thread, on a free loopback
port, with the tiny checkpoint's recommender."""

import threading
import time
from contextlib import contextmanager

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Decode with one torch thread, as the service does by default: on a small shared machine
    a second thread's wake-ups cost more than it saves. Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def retriever(tiny_checkpoint):
    from genrec_spec.serve.config import ServeConfig
    from genrec_spec.serve.retrieval import Retriever

    config = ServeConfig()
    return Retriever.load(tiny_checkpoint, None, config.max_k, config.history_cache_mb << 20)


@pytest.fixture(scope="session")
def start_service(retriever):
    """start_service(**ServeConfig fields, llm=None, recommender=None) -> context manager
    yielding the base URL (serving `recommender`, a Retriever, or the tiny checkpoint's); the
    server stops when the block ends."""
    import uvicorn

    from genrec_spec.serve.app import create_app
    from genrec_spec.serve.config import ServeConfig

    @contextmanager
    def start(llm=None, recommender=None, **settings):
        app = create_app(ServeConfig(port=0, **settings), recommender or retriever, llm=llm)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(timeout=30)

    return start


@pytest.fixture(scope="module")
def service(start_service):
    """A service with the default settings, shared by a test module."""
    with start_service() as url:
        yield url
