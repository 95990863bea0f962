"""The tools that read run dirs: report, matrix, repro, gate, export, validate, sweep summaries."""
