"""Prints ``tick I TIME`` once a second, five times, with plain ``print`` (no flush): the test
reads the job's output file meanwhile and measures how late each line arrives there.

Usage: print_each_second.py [--init]; with --init it calls ``hvd.init()`` first, as a training
script does.
"""

import sys
import time

if "--init" in sys.argv:
    import hpc_horovod as hvd

    hvd.init()
for i in range(5):
    print(f"tick {i} {time.time():.3f}")
    time.sleep(1)
