"""In-process tests run on uvloop, the event loop the programs use (cli._run)."""

import uvloop


def pytest_asyncio_loop_factories(config, item):
    return {"uvloop": uvloop.new_event_loop}
