"""Command-line tools built on the plugin.

- ``hyscale-train`` (:mod:`.train`): train a GPT with stock or HyScale DSA layers, Megatron's flags.
- ``hyscale-compare`` (:mod:`.compare`): stock vs HyScale, same config, back to back; CSV, summary, plot.
- ``hyscale-longest`` (:mod:`.longest`): the longest sequence each trains, one length at a time.

:mod:`.common` holds what they share (argument files, one-line errors, run commands, the runner).
The plugin itself (``hyscale_megatron.config``, ``arguments``, ``specs``, ``dsa``, ``replay``, ...)
does not import this package.
"""
