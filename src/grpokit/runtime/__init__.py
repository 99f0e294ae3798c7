"""The process grpokit runs in: its device and precision, progress bars, random streams, memory allocator,
cache folder, and the threads that must never hold up its exit. Below every other layer but the sandbox: it
imports nothing of grpokit."""
