"""The end-to-end benchmark's stages (`benchmarks/run.py` is its command line):

clock      the time guard and the log, counted from the start of the run
workloads  what runs: the models (real shapes at random weights, the bundled trained model) and their byte counts
measure    how a system is measured: TTFT, decode and beam tokens/s, peak memory, mira's counters, bandwidth
systems    what is compared: all resident, accelerate offload, mira-hf configurations; one system set up, measured
           and torn down
limits     the time per token no exact cache can beat (Belady's bytes over the link, bytes touched in device memory)
render     comparisons, tables, Markdown, the plot, the JSON and the printed summary
"""

GB = 1e9  # the decimal gigabyte of every table and JSON field named *_gb / *_gbps
