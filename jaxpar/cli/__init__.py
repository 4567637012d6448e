"""The `jaxpar` command: the parser and dispatch (`main`), what the subcommands run
(`commands`), `jaxpar inspect` (`inspect`) and `jaxpar bench` (`bench`)."""
