// How fast one core runs `vpmaddubsw` on 256-bit registers, the multiply of the AVX2 kernels: alone, each followed by
// the `vpaddw` that adds it as i16 (as the Q4_K lanes kernel does), with the activation word broadcast from memory as
// well, and `vpmaddwd` alone; then the clock from a chain of dependent adds. Written in inline assembly, so the loops
// hold these instructions and the loop counter's alone (eight or four independent destinations, no copies). A probe
// of the CPU, not of the engine (docs/figures.md, "Issue 15 on a Zen 2 EPYC").
//
//   gcc -O2 -mavx2 benches/probes/maddubs-rate.c -o /tmp/maddubs-rate && /tmp/maddubs-rate
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){ long n=100000000; double t;
 static int buf[64] __attribute__((aligned(64)));
 for(int i=0;i<64;i++)buf[i]=i*0x01010101;
 t=now();
 for(long i=0;i<n;i++){ __asm__ volatile(
  "vpmaddubsw %%ymm14,%%ymm15,%%ymm0\n vpmaddubsw %%ymm14,%%ymm15,%%ymm1\n vpmaddubsw %%ymm14,%%ymm15,%%ymm2\n vpmaddubsw %%ymm14,%%ymm15,%%ymm3\n"
  "vpmaddubsw %%ymm14,%%ymm15,%%ymm4\n vpmaddubsw %%ymm14,%%ymm15,%%ymm5\n vpmaddubsw %%ymm14,%%ymm15,%%ymm6\n vpmaddubsw %%ymm14,%%ymm15,%%ymm7\n"
  :::"xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7");}
 t=now()-t; printf("vpmaddubsw alone: %.2f G/s\n",8.0*n/t/1e9);
 t=now();
 for(long i=0;i<n;i++){ __asm__ volatile(
  "vpmaddubsw %%ymm14,%%ymm15,%%ymm0\n vpaddw %%ymm0,%%ymm8,%%ymm8\n vpmaddubsw %%ymm14,%%ymm15,%%ymm1\n vpaddw %%ymm1,%%ymm9,%%ymm9\n"
  "vpmaddubsw %%ymm14,%%ymm15,%%ymm2\n vpaddw %%ymm2,%%ymm10,%%ymm10\n vpmaddubsw %%ymm14,%%ymm15,%%ymm3\n vpaddw %%ymm3,%%ymm11,%%ymm11\n"
  :::"xmm0","xmm1","xmm2","xmm3","xmm8","xmm9","xmm10","xmm11");}
 t=now()-t; printf("vpmaddubsw + vpaddw: %.2f G pairs/s\n",4.0*n/t/1e9);
 t=now();
 for(long i=0;i<n;i++){ __asm__ volatile(
  "vpbroadcastd (%0),%%ymm12\n vpmaddubsw %%ymm12,%%ymm15,%%ymm0\n vpaddw %%ymm0,%%ymm8,%%ymm8\n"
  "vpbroadcastd 4(%0),%%ymm13\n vpmaddubsw %%ymm13,%%ymm15,%%ymm1\n vpaddw %%ymm1,%%ymm9,%%ymm9\n"
  "vpbroadcastd 8(%0),%%ymm12\n vpmaddubsw %%ymm12,%%ymm14,%%ymm2\n vpaddw %%ymm2,%%ymm10,%%ymm10\n"
  "vpbroadcastd 12(%0),%%ymm13\n vpmaddubsw %%ymm13,%%ymm14,%%ymm3\n vpaddw %%ymm3,%%ymm11,%%ymm11\n"
  ::"r"(buf):"xmm0","xmm1","xmm2","xmm3","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13");}
 t=now()-t; printf("broadcast + vpmaddubsw + vpaddw: %.2f G triples/s\n",4.0*n/t/1e9);
 t=now();
 for(long i=0;i<n;i++){ __asm__ volatile(
  "vpmaddwd %%ymm14,%%ymm15,%%ymm0\n vpmaddwd %%ymm14,%%ymm15,%%ymm1\n vpmaddwd %%ymm14,%%ymm15,%%ymm2\n vpmaddwd %%ymm14,%%ymm15,%%ymm3\n"
  :::"xmm0","xmm1","xmm2","xmm3");}
 t=now()-t; printf("vpmaddwd alone: %.2f G/s\n",4.0*n/t/1e9);
 unsigned long x=0;
 t=now();
 for(long i=0;i<n;i++){ __asm__ volatile("add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n":"+r"(x)); }
 t=now()-t; printf("clock: %.2f GHz (x=%lu)\n",4.0*n/t/1e9,x);
}
