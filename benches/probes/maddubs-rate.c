// How fast one core runs `vpmaddubsw` on 256-bit registers, the multiply of the AVX2 kernels: alone, each followed by
// the `vpaddw` that adds it as i16 (as the Q4_K lanes kernel does), with the activation word broadcast from memory as
// well, and `vpmaddwd` alone; then the clock from a chain of dependent adds. Written in inline assembly, so the loops
// hold these instructions and the loop counter's alone (eight or four independent destinations, no copies). A probe
// of the CPU, not of the engine.
//
//   gcc -O2 -mavx2 benches/probes/maddubs-rate.c -o /tmp/maddubs-rate && /tmp/maddubs-rate
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
// Runs one asm block n times and prints `per` times n over the seconds taken, in G a second.
#define RATE(label, per, ...) do { double t0=now(); for(long i=0;i<n;i++){ __asm__ volatile(__VA_ARGS__); } \
  printf(label, (per)*(double)n/(now()-t0)/1e9); } while(0)
#define M "vpmaddubsw %%ymm14,%%ymm15,"
int main(){ long n=100000000; unsigned long x=0;
 static int buf[64] __attribute__((aligned(64)));
 for(int i=0;i<64;i++)buf[i]=i*0x01010101;
 RATE("vpmaddubsw alone: %.2f G/s\n", 8,
  M"%%ymm0\n" M"%%ymm1\n" M"%%ymm2\n" M"%%ymm3\n" M"%%ymm4\n" M"%%ymm5\n" M"%%ymm6\n" M"%%ymm7\n"
  :::"xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7");
 RATE("vpmaddubsw + vpaddw: %.2f G pairs/s\n", 4,
  M"%%ymm0\n vpaddw %%ymm0,%%ymm8,%%ymm8\n" M"%%ymm1\n vpaddw %%ymm1,%%ymm9,%%ymm9\n"
  M"%%ymm2\n vpaddw %%ymm2,%%ymm10,%%ymm10\n" M"%%ymm3\n vpaddw %%ymm3,%%ymm11,%%ymm11\n"
  :::"xmm0","xmm1","xmm2","xmm3","xmm8","xmm9","xmm10","xmm11");
 RATE("broadcast + vpmaddubsw + vpaddw: %.2f G triples/s\n", 4,
  "vpbroadcastd (%0),%%ymm12\n vpmaddubsw %%ymm12,%%ymm15,%%ymm0\n vpaddw %%ymm0,%%ymm8,%%ymm8\n"
  "vpbroadcastd 4(%0),%%ymm13\n vpmaddubsw %%ymm13,%%ymm15,%%ymm1\n vpaddw %%ymm1,%%ymm9,%%ymm9\n"
  "vpbroadcastd 8(%0),%%ymm12\n vpmaddubsw %%ymm12,%%ymm14,%%ymm2\n vpaddw %%ymm2,%%ymm10,%%ymm10\n"
  "vpbroadcastd 12(%0),%%ymm13\n vpmaddubsw %%ymm13,%%ymm14,%%ymm3\n vpaddw %%ymm3,%%ymm11,%%ymm11\n"
  ::"r"(buf):"xmm0","xmm1","xmm2","xmm3","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13");
 RATE("vpmaddwd alone: %.2f G/s\n", 4,
  "vpmaddwd %%ymm14,%%ymm15,%%ymm0\n vpmaddwd %%ymm14,%%ymm15,%%ymm1\n"
  "vpmaddwd %%ymm14,%%ymm15,%%ymm2\n vpmaddwd %%ymm14,%%ymm15,%%ymm3\n"
  :::"xmm0","xmm1","xmm2","xmm3");
 RATE("clock: %.2f GHz\n", 4, "add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n":"+r"(x));
 return x == 1;
}
