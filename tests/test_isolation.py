"""Tests do not leak process state into the tests after them (conftest.py), whatever order they run in.

Regression: ``fewbit_design.cli.main`` called in-process on an interrupted command ends with SIGINT ignored (right for
the process that is about to exit: a second Ctrl-C while exiting prints no traceback), and that stayed so for every
later test of the same process: ``test_offload.py``'s Ctrl-C tests then saw no ``KeyboardInterrupt``. They had run
before ``test_signals_cli.py`` only by the alphabetical order of a flat tests/ folder.
"""

from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")


def test_a_sigint_handler_a_test_changes_is_restored_after_it(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(
        """
        import signal

        def test_ignores_sigint():
            signal.signal(signal.SIGINT, signal.SIG_IGN)

        def test_sees_the_default_handler():
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=2)
