"""Support for the tests and the benchmarks, shipped so a benchmark runs from an installed package:
``serve_process`` starts ``lorapage serve`` as a child process. Nothing in the library imports it."""
