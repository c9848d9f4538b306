"""What the benchmarks share, one job a module; a benchmark imports from here, never from another benchmark.

timing       a call's wall time (GC paused), a thread's blocked time, medians and percentiles, the machine's load
results      the long-format CSV (write, read back), its git sha and torch version, progress lines
report       bench's summary rows and bar chart; a sweep point's CSV name, its headline, its summary row and plot
hosts        2 ranks as 2 torchrun hosts joined by a shaped link
sweep        the two-host sweep of the dense backward against T_comm: options, config, main, depth, repetitions
exposure     exposed communication from the ranks' blocked times, the efficiency, the ratio a point measured
calibration  on the ranks: T_comm and one dense layer's backward (imports torch; the modules above do not, so a
             sweep's launcher starts its hosts without torch's import)
"""
