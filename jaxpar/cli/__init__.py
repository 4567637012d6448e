"""The `jaxpar` command: the parser and dispatch (`main`), what the subcommands run
(`commands`) and `jaxpar inspect` (`inspect`); `jaxpar bench` runs jaxpar.bench."""
