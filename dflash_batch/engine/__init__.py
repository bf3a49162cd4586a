"""The engine: continuous-batching speculative decoding behind `request.Engine` (see engine.py;
build.py turns a job into one)."""
