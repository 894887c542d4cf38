"""The start-up heap is moved out of the cyclic collector's reach."""

import gc

from fastdeploy.utils.gc_utils import freeze_gc_heap


def _in_collected_generations(obj: object) -> bool:
    # gc.get_objects() lists generations 0-2 only: frozen objects are in none of them.
    return any(o is obj for o in gc.get_objects())


def test_freeze_moves_live_objects_out_of_the_collected_generations():
    gc.unfreeze()
    try:
        kept = [{"a": 1}]
        assert _in_collected_generations(kept)
        freeze_gc_heap()
        assert not _in_collected_generations(kept)
        assert gc.get_freeze_count() > 0
        later = [{"b": 2}]  # objects made after the freeze are collected as usual
        assert _in_collected_generations(later)
    finally:
        gc.freeze()  # leave whatever the session froze frozen


def test_the_engine_freezes_its_start_up_heap(smol_llm):
    model = smol_llm.llm_engine.engine_core.worker.model_runner.model
    assert not _in_collected_generations(model)


def test_cycles_frozen_with_the_heap_are_still_freed_at_exit():
    """Without the unfreeze at exit, frozen cycles outlive the interpreter's last collection
    (nanobind extensions then report their objects leaked)."""
    import subprocess
    import sys

    code = (
        "import gc, sys\n"
        "from fastdeploy.utils.gc_utils import freeze_gc_heap\n"
        "class Cycle:\n"
        "    def __del__(self): sys.stdout.write('freed\\n')\n"
        "freeze_gc_heap()\n"
        "c = Cycle(); c.me = c; del c\n"
        "gc.freeze()\n"
        "sys.stdout.write('exiting\\n')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.split() == ["exiting", "freed"]
