"""A step compiled and described: `run.prepare` checks a config against the mesh, has the
step built and compiled (jaxpar.step), and `describe` builds its report from the compiled
program and the engine's leaves, counted once (jaxpar.parallel.leaf_layout)."""
