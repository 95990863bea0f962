"""The core the engines build on: config schema and precedence, dataset rows, sinks and atomic artifacts, resume,
run dirs, platform, environment, weights, video, distributed layouts, errors."""
