"""The documentation site's machinery (mkdocs.yml, `make docs`): what the site is built from, never typed by hand.

`reference` writes the generated pages under docs/reference (`lorafleet docs-reference`) from the sources they
describe (settings schema, the proxy's registry and app, the CLI parsers, the Makefile); the benchmark pages'
figures come from bench/results JSON through the macros. Nothing here is imported by the services.
"""
