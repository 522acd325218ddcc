"""SWE-style tasks: the published instance formats, local git mirrors, and a builder that
turns a real package's source tree and test suite into instances."""
