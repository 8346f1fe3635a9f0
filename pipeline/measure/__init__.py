"""Measurement: one benchmark arm in a fresh process (bench_arm), spread and
comparison (stats), the settings sweep (tune), llama.cpp's KL statistics (kld), tensor-by-tensor
graph diffs (graph_diff) and the HTML report."""
