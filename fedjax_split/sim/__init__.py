"""Simulation: execution strategies for a round of many clients in one process (vmapped, one at a
time, sharded over devices) and the personalised evaluation."""
