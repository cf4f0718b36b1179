"""The first error of a failed NVIDIA build (templates/nvidia-first-error.sh.j2) when kbuild names
the external module's files relative to its M= dir, as the 7.x kernels' kbuild does."""

from __future__ import annotations

from tests.unit.test_first_error import first_error


def test_a_7_x_kbuild_path_relative_to_kernel_open_is_named_from_kernel_open(tmp_path):
    # kbuild of Debian trixie-backports' 7.3.4 names the files relative to M= (kernel-open/): the kernel
    # hook's build of 595.45.04 printed the error line below (tests/e2e/test_driver_build_trixie.py);
    # quoted as "././common/..." it did not say which tree's common/ it is
    text = ("  CONFTEST: of_gpio_h_present\n  CC [M]  nvidia/nv.o\n"
            "In file included from ././common/inc/nv-linux.h:20,\n"
            "././common/inc/nv-linux.h:1730:10: fatal error: linux/of_gpio.h: No such file or directory\n"
            " 1730 | #include <linux/of_gpio.h>\n      |          ^~~~~~~~~~~~~~~~~~\ncompilation terminated.\n"
            "make[5]: *** [scripts/Makefile.build:203: nvidia/nv.o] Error 1\n")
    assert first_error(text, tmp_path) == (
        "kernel-open/common/inc/nv-linux.h:1730:10: fatal error: linux/of_gpio.h: No such file or directory\n")
