"""tools/spill_map.py: the SASS parser counts STL / LDL under the innermost source line (predicated ones
too) and nothing else; a snippet with no spills counts none (so the count can fail)."""
from tools.spill_map import spills

SASS = '''
        //## File "/x/discrete/kernels/gemv.cuh", line 349 inlined at "/x/megakernel/megakernel.cu", line 100
        /*0010*/                   STL [R1+0x10], R4 ;
        /*0020*/                   LDG.E.128.CONSTANT R8, desc[UR4][R2.64] ;
        //## File "/x/discrete/kernels/gdn.cuh", line 172
        /*0030*/               @!P0 LDL R2, [R1+0x130] ;
        /*0040*/                   LDL.64 R6, [R1+0x8] ;
        /*0050*/                   STS [R3], R2 ;
'''


def test_counts_spills_by_line():
    c = spills(SASS)
    assert c[(("gemv.cuh", 349), "STL")] == 1
    assert c[(("gdn.cuh", 172), "LDL")] == 2
    assert sum(c.values()) == 3


def test_no_spills_counts_none():
    assert not spills(SASS.replace("STL", "STS").replace("LDL", "LDS"))
