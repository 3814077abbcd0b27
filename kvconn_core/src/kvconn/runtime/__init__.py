"""The I/O around the sans-I/O core: sockets, threads, the transport."""
