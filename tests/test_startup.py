"""grpo_lab/startup.py: the heavy imports run with the cyclic collector paused, and what they
allocated is frozen out of its sight; the collector itself is back on afterwards."""

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""\
    import gc
    from grpo_lab.startup import gc_paused

    assert gc.isenabled() and gc.get_freeze_count() == 0
    import grpo_lab.trainer  # torch, transformers' GPT-2: through models.py and fast.py
    assert gc.isenabled(), "the collector stayed off after the import"
    assert gc.get_freeze_count() > 100_000, gc.get_freeze_count()

    seen = []
    try:
        with gc_paused():
            seen.append(gc.isenabled())
            raise KeyError("inside")
    except KeyError:
        pass
    assert seen == [False] and gc.isenabled(), "not restored after an exception"

    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled(), "a collector the caller had turned off was turned on"
    print("ok")
""")


def test_imports_freeze_their_objects_and_leave_the_collector_as_it_was():
    # a fresh interpreter: the import must be the first, and freezing is for good
    p = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
