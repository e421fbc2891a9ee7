"""Eight emulated CPU devices for the doctests of spmd/ and strategies/ too (tests/conftest.py does the same),
set before anything starts JAX's backend."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
