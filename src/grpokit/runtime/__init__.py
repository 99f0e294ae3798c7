"""The process grpokit runs in: its device and precision, progress bars, random streams, memory allocator
and cache folder. Below every other layer but the sandbox: it imports nothing of grpokit."""
