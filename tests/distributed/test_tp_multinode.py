"""Two "nodes" on loopback: the head runs the engine and rank 0, a headless worker node runs rank 1.

vLLM's flags: the worker node is ``fastdeploy serve MODEL --headless -tp 2 --nnodes 2 --node-rank 1
--master-addr 127.0.0.1 --master-port P``; its rank joins the head's group (the store at P) and
the head's executor (P + 1). The tokens equal one node's.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from tests.model_executor.utils import TINY_VOCAB, build_tiny_checkpoint

pytestmark = pytest.mark.slow

COMMON = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, skip_tokenizer_init=True)


def test_two_nodes_on_loopback_equal_one_node(tmp_path):
    from fastdeploy.executor.multiproc_executor import free_port_pair

    path = build_tiny_checkpoint("Ernie4_5ForCausalLM", tmp_path / "ernie")
    prompts = [{"prompt_token_ids": np.random.default_rng(i).integers(3, TINY_VOCAB, 9 + i).tolist()}
               for i in range(3)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in LLM(path, **COMMON).generate(prompts, params)]

    port = free_port_pair()
    node1 = subprocess.Popen(
        [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", path, "--headless", "-tp", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory-bytes", "4M"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        head = LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port,
                   **COMMON)
        executor = head.llm_engine.engine_core.worker
        assert len(executor.procs) == 1 and executor.world_size == 2  # rank 1 is the other node's
        got = [list(o.outputs[0].token_ids) for o in head.generate(prompts, params)]
        assert got == want
        executor.shutdown()  # tells the remote rank to stop, so the worker node exits
        assert node1.wait(60) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
        print(node1.stdout.read()[-3000:])
