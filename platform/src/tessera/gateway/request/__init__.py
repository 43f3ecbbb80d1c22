"""A generation request as an object moving through named phases, one module each; ``pipeline.py`` holds
their order and ``context.py`` the object. (Nothing is re-exported here: the phases import each other's
modules, and a package ``__init__`` that imported them back would close a cycle.)"""
