"""gpuos_tools.cuda.elf against real nvcc 13 output and cuobjdump's reading of the same files.

The fixtures in tests/data/ come from tests/data/kernels.cu through scripts/make-test-cubins,
which also stores cuobjdump's listings of them (*.cuobjdump.txt, *.lelf.txt): the tests compare
what this module reads with what NVIDIA's tool reads, and with layouts derived by hand from the
C ABI for the kernels' parameter lists.
"""

from __future__ import annotations

import re
import struct
import sys
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from gpuos_tools.cuda import elf
from gpuos_tools.errors import ExitCode, GpuosError

DATA = Path(__file__).parent / "data"


def read(name: str) -> bytes:
    return (DATA / name).read_bytes()


CUBIN = read("kernels.sm_90.cubin")
RDC_CUBIN = read("kernels.rdc.sm_90.cubin")

# By hand from kernels.cu: each parameter at the next offset aligned to its own alignment.
EXPECTED_LAYOUTS = {
    "saxpy": [(0, 0, 4), (1, 8, 8), (2, 16, 8), (3, 24, 4)],
    "_Z4fillIfEvPT_S0_j": [(0, 0, 8), (1, 8, 4), (2, 12, 4)],
    "_Z4fillIdEvPT_S0_j": [(0, 0, 8), (1, 8, 8), (2, 16, 4)],
    "_Z5shiftP4Vec3S_i": [(0, 0, 8), (1, 8, 24), (2, 32, 4)],
    "_Z5mixedcidPf4Vec33BigsPc": [
        (0, 0, 1),
        (1, 4, 4),
        (2, 8, 8),
        (3, 16, 8),
        (4, 24, 24),
        (5, 48, 40),
        (6, 88, 2),
        (7, 96, 8),
    ],
    "_Z5twicePf": [(0, 0, 8)],
    "_Z6noargsv": [],
}


# Lines of `cuobjdump -elf`: a symbol, a KPARAM_INFO value, a one-number value.
SYMBOL = re.compile(r"^\s+\S+\s+\S+\s+\S+\s+FUNC\s+\S+\s+\S+\s+(\S+)\s+\S+\s+(\S+)$")
KPARAM = re.compile(
    r"^\tValue:\tIndex : 0x\w+\tOrdinal : (0x\w+)\tOffset  : (0x\w+)\tSize    : (0x\w+)"
)
HVAL = re.compile(r"^\tValue:\t(0x\w+)")
LISTING = re.compile(r"^(ELF|PTX) file .*\.sm_(\d+)\.\w+$", re.M)


class Cuobjdump:
    """What ``cuobjdump -elf`` printed for a cubin: entry symbols and .nv.info sections."""

    def __init__(self, text: str):
        self.entries: list[str] = []
        self.functions: list[str] = []
        self.kparams: dict[str, list[tuple[int, int, int]]] = {}
        self.param_size: dict[str, int] = {}
        self.record_count: dict[str, int] = {}
        section = None
        last_attr = None
        for line in text.splitlines():
            if m := SYMBOL.match(line):
                self.functions.append(m[2])
                if m[1] == "ENTRY":
                    self.entries.append(m[2])
            elif m := re.match(r"^(\.\S+)", line):
                section = m[1]
                self.record_count[section] = 0
            elif m := re.match(r"^\tAttribute:\t(\S+)", line):
                last_attr = m[1]
                self.record_count[section] += 1
            elif m := KPARAM.match(line):
                kernel = section.removeprefix(".nv.info.")
                self.kparams.setdefault(kernel, []).append(tuple(int(v, 16) for v in m.groups()))
            elif last_attr == "EIATTR_CBANK_PARAM_SIZE" and (m := HVAL.match(line)):
                self.param_size[section.removeprefix(".nv.info.")] = int(m[1], 16)


DUMP = Cuobjdump((DATA / "kernels.sm_90.cuobjdump.txt").read_text())
RDC_DUMP = Cuobjdump((DATA / "kernels.rdc.sm_90.cuobjdump.txt").read_text())


def kinds(entries: list[elf.FatbinEntry]) -> list[tuple[str, int]]:
    return [("ELF" if e.kind == elf.KIND_ELF else "PTX", e.arch) for e in entries]


def lelf(name: str) -> list[tuple[str, int]]:
    """(kind, sm) per line of a ``cuobjdump -lelf -lptx`` listing, in its order."""
    text = (DATA / f"{name}.lelf.txt").read_text()
    return [(m[1], int(m[2])) for m in LISTING.finditer(text)]


# --- image_format --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("kernels.sm_90.cubin", "cubin"),
        ("kernels.rdc.sm_90.cubin", "cubin"),
        ("kernels.fatbin", "fatbin"),
        ("kernels.zstd.fatbin", "fatbin"),
        ("kernels.lz.fatbin", "fatbin"),
        ("kernels.fatbin-wrapper.bin", "fatbin"),
        ("kernels.ptx", "ptx"),
    ],
)
def test_image_format_of_fixtures(name: str, fmt: str) -> None:
    assert elf.image_format(read(name)) == fmt


def test_image_format_unknown() -> None:
    host_elf = Path(sys.executable).resolve().read_bytes()[:4096]
    assert host_elf[:4] == b"\x7fELF"
    assert elf.image_format(host_elf) == "unknown"
    assert elf.image_format(b"\x7fELF") == "unknown"
    assert elf.image_format(b"") == "unknown"
    assert elf.image_format(b"hello") == "unknown"


def test_image_format_ptx_after_blank_lines() -> None:
    # The PTX nvcc stores in a fatbin begins with newlines before ".version".
    ptx = [e for e in elf.fatbin_entries(read("kernels.fatbin")) if e.kind == elf.KIND_PTX]
    assert ptx[0].payload.startswith(b"\n")
    assert elf.image_format(ptx[0].payload) == "ptx"


# --- kernels -------------------------------------------------------------------------------------


def test_kernels_match_cuobjdump_entries() -> None:
    assert elf.kernels(CUBIN) == DUMP.entries
    assert sorted(DUMP.entries) == sorted(EXPECTED_LAYOUTS)


def test_device_function_in_rdc_cubin_is_not_a_kernel() -> None:
    # _Z6helperf has .text and .nv.info sections like a kernel, but no ENTRY flag.
    with open(DATA / "kernels.rdc.sm_90.cubin", "rb") as f:
        sections = {s.name for s in ELFFile(f).iter_sections()}
    assert {".text._Z6helperf", ".nv.info._Z6helperf"} <= sections
    assert "_Z6helperf" in RDC_DUMP.functions
    assert elf.kernels(RDC_CUBIN) == RDC_DUMP.entries
    assert "_Z6helperf" not in elf.kernels(RDC_CUBIN)
    assert sorted(elf.kernels(RDC_CUBIN)) == sorted(EXPECTED_LAYOUTS)


def test_kernels_rejects_non_cubin() -> None:
    with pytest.raises(GpuosError) as err:
        elf.kernels(read("kernels.fatbin"))
    assert err.value.code == ExitCode.BAD_INPUT


def test_kernels_rejects_cut_cubin() -> None:
    with pytest.raises(GpuosError) as err:
        elf.kernels(CUBIN[:4096])
    assert err.value.code == ExitCode.BAD_INPUT


# --- parameters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", sorted(EXPECTED_LAYOUTS))
def test_param_layout_matches_abi_and_cuobjdump(kernel: str) -> None:
    layout = elf.param_layout(CUBIN, kernel)
    assert layout == EXPECTED_LAYOUTS[kernel]
    assert layout == sorted(DUMP.kparams.get(kernel, []))


@pytest.mark.parametrize("kernel", sorted(EXPECTED_LAYOUTS))
def test_param_bytes_matches_cuobjdump(kernel: str) -> None:
    expected = DUMP.param_size.get(kernel, 0)
    assert elf.param_bytes(CUBIN, kernel) == expected
    layout = EXPECTED_LAYOUTS[kernel]
    assert expected == (max(off + size for _, off, size in layout) if layout else 0)


def test_param_layouts_all_at_once() -> None:
    assert elf.param_layouts(CUBIN) == EXPECTED_LAYOUTS
    assert elf.param_layouts(RDC_CUBIN) == EXPECTED_LAYOUTS


def test_param_layout_of_missing_kernel() -> None:
    with pytest.raises(GpuosError) as err:
        elf.param_layout(CUBIN, "_Z7missingv")
    assert err.value.code == ExitCode.BAD_INPUT


@pytest.mark.parametrize("name", ["kernels.sm_90.cubin", "kernels.rdc.sm_90.cubin"])
def test_nv_info_records_count_matches_cuobjdump(name: str) -> None:
    dump = DUMP if name == "kernels.sm_90.cubin" else RDC_DUMP
    with open(DATA / name, "rb") as f:
        sections = [s for s in ELFFile(f).iter_sections() if s.name.startswith(".nv.info")]
        assert sections
        for section in sections:
            records = list(elf.nv_info_records(section.data()))
            assert len(records) == dump.record_count[section.name], section.name


def test_nv_info_records_cut_short() -> None:
    with open(DATA / "kernels.sm_90.cubin", "rb") as f:
        info = ELFFile(f).get_section_by_name(".nv.info._Z5mixedcidPf4Vec33BigsPc").data()
    with pytest.raises(GpuosError):
        list(elf.nv_info_records(info[:-2]))
    with pytest.raises(GpuosError):
        list(elf.nv_info_records(b"\x07\x17\x00\x00"))  # no such format


# --- fatbins -------------------------------------------------------------------------------------


def test_extract_cubins_matches_cuobjdump_listing() -> None:
    fatbin = read("kernels.fatbin")
    entries = elf.fatbin_entries(fatbin)
    assert kinds(entries) == lelf("kernels.fatbin")
    assert [e.compression for e in entries] == ["none", "none", "zstd"]  # nvcc compresses only PTX
    cubins = elf.extract_cubins(fatbin)
    assert [arch for arch, _ in cubins] == [80, 90]
    # The sm_90 entry is the very cubin `nvcc -cubin -arch=sm_90` writes.
    assert cubins[1][1] == CUBIN
    for _, cubin in cubins:
        assert elf.image_format(cubin) == "cubin"
        assert elf.param_layouts(cubin) == EXPECTED_LAYOUTS


def test_zstd_fatbin_decompresses_to_same_images() -> None:
    plain = elf.fatbin_entries(read("kernels.fatbin"))
    packed = elf.fatbin_entries(read("kernels.zstd.fatbin"))
    assert [e.compression for e in packed] == ["zstd", "zstd", "zstd"]
    assert [(e.kind, e.arch) for e in packed] == [(e.kind, e.arch) for e in plain]
    assert [e.payload for e in packed] == [e.payload for e in plain]
    assert b".entry saxpy" in packed[2].payload


def test_lz_fatbin_entries_are_reported_not_extracted() -> None:
    fatbin = read("kernels.lz.fatbin")
    entries = elf.fatbin_entries(fatbin)
    assert kinds(entries) == lelf("kernels.lz.fatbin")
    assert {e.compression for e in entries} == {"lz"}
    assert elf.extract_cubins(fatbin) == []


def test_fatbins_back_to_back_with_padding() -> None:
    data = read("kernels.fatbin") + bytes(8) + read("kernels.zstd.fatbin")
    assert [arch for arch, _ in elf.extract_cubins(data)] == [80, 90, 80, 90]


def test_truncated_fatbin() -> None:
    fatbin = read("kernels.fatbin")
    for cut in (8, 40, len(fatbin) - 100):
        with pytest.raises(GpuosError) as err:
            elf.fatbin_entries(fatbin[:cut])
        assert err.value.code == ExitCode.TRUNCATED


def test_fatbin_garbage_after_first() -> None:
    with pytest.raises(GpuosError) as err:
        elf.fatbin_entries(read("kernels.fatbin") + b"\x01" * 16)
    assert err.value.code == ExitCode.BAD_INPUT


def test_fatbin_with_empty_header_does_not_loop() -> None:
    with pytest.raises(GpuosError) as err:
        elf.fatbin_entries(struct.pack("<IHHQ", elf.FATBIN_MAGIC, 1, 0, 0))
    assert err.value.code == ExitCode.BAD_INPUT


def test_fatbin_wrapper_is_not_an_image() -> None:
    wrapper = read("kernels.fatbin-wrapper.bin")
    assert struct.unpack_from("<II", wrapper) == (elf.FATBIN_WRAPPER_MAGIC, 1)
    with pytest.raises(GpuosError) as err:
        elf.extract_cubins(wrapper)
    assert err.value.code == ExitCode.BAD_INPUT


# --- demangle ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mangled", "plain"),
    [
        ("_Z3addPfPKfi", "add(float*, float const*, int)"),
        ("_Z4fillIfEvPT_S0_j", "void fill<float>(float*, float, unsigned int)"),
        ("_Z4fillIdEvPT_S0_j", "void fill<double>(double*, double, unsigned int)"),
        ("_Z5shiftP4Vec3S_i", "shift(Vec3*, Vec3, int)"),
        ("_Z5mixedcidPf4Vec33BigsPc", "mixed(char, int, double, float*, Vec3, Big, short, char*)"),
        ("saxpy", "saxpy"),  # extern "C"
        ("i", "i"),  # not "int": bare type encodings are not symbols
        ("_Z3ad", "_Z3ad"),  # broken (length 3, 2 chars follow): returned unchanged
        ("_Z3add", "add"),  # a mangled variable name
        ("", ""),
    ],
)
def test_demangle(mangled: str, plain: str) -> None:
    assert elf.demangle(mangled) == plain


def test_demangle_names_from_cubin() -> None:
    names = {elf.demangle(k) for k in elf.kernels(CUBIN)}
    assert "twice(float*)" in names
    assert "noargs()" in names


def test_demangle_is_cached() -> None:
    elf.demangle("_Z5twicePf")
    hits = elf.demangle.cache_info().hits
    assert elf.demangle("_Z5twicePf") == "twice(float*)"
    assert elf.demangle.cache_info().hits == hits + 1
